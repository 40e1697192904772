"""The composition root of a worker: decides what bsrun installs in this process, and when.

Runs first in every Python process of a bsrun launch (through the sitecustomize). A
process with a rank from torchrun, Horovod or MPI is a training worker: bsrun's patches
go in as soon as the script imports torch (and Horovod's as soon as it imports
horovod.torch; a post-import hook, so processes that never import them pay nothing), a
tuning trial or a profile adds its step listener, and the rank's part of the run summary
is written at exit. This is the only module that installs anything.
"""

import atexit
import os

from bsrun.config import PROFILE_DIR_ENV, TRIAL_OUT_ENV, WORKER_PID_ENV, worker_setting
from bsrun.inject import state
from bsrun.inject.import_hook import when_imported


def _install_torch_patches(_torch):
    rank = state.worker_rank()
    if state.config().enabled:
        from bsrun.inject import patches

        patches.install()
        state.debug("torch patches installed")
    if worker_setting(TRIAL_OUT_ENV):  # a `bsrun tune` trial: time the steps, end the job
        from bsrun.inject import trial

        trial.install(rank)
        state.debug("tuning trial installed")
    if worker_setting(PROFILE_DIR_ENV):  # `bsrun profile`: record spans, end at its last step
        from bsrun.inject import record

        record.install(rank)
        state.debug("profile recorder installed")


def _install_horovod_patches(_hvd_torch):
    """After horovod.torch has fully executed (torch, and so our torch patches, came first)."""
    if state.config().enabled:
        from bsrun.inject import horovod

        horovod.install()
        state.debug("horovod patches installed")


def start():
    rank = state.worker_rank()
    if rank is None or worker_setting(WORKER_PID_ENV):
        return  # not a worker, or a child (data loader, subprocess) of one
    os.environ[WORKER_PID_ENV] = str(os.getpid())
    state.debug(f"bootstrap in pid {os.getpid()}")
    when_imported("torch", _install_torch_patches)
    when_imported("horovod.torch", _install_horovod_patches)
    from bsrun.inject import heartbeat, report

    heartbeat.start(rank)
    atexit.register(report.write_rank_report, rank)
