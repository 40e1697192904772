"""The composition root of every process of a launch: decides what bsrun installs in it, and when.

Runs first in every Python process below a bsrun launch (the sitecustomize, wherever
`BSRUN_ACTIVE=1`), whoever started it: bsrun, torchrun, a shell script,
`torch.multiprocessing.spawn`, Lightning or Accelerate. The only module that installs
anything:

- at `import torch` (a post-import hook, so a process that never imports torch pays
  nothing): bsrun's patches (scheduling on) or, with --no-schedule, only a wrapper of
  DDP's constructor; for a profile, its construction hooks. The same for horovod.torch;
- where the process becomes a data-parallel worker (`state.become_worker`: it builds a DDP
  model or an `hvd.DistributedOptimizer`, its rank and world size the process group's; or
  it starts with a rank that a launcher put in its environment and is not a child of a
  worker): the heartbeat (and the watch on the launcher), the rank's report at exit, and
  a trial's timer or a profile's recorder. Every other process (a DataLoader's workers, a
  launcher's own Python) stays a bystander: the import hooks and nothing else;
- the process the launcher started itself watches the launcher from its start.
"""

import atexit
import functools
import os
import sys

from bsrun.config import LAUNCHER_PID_ENV, PROFILE_DIR_ENV, TRIAL_OUT_ENV, WORKER_PID_ENV, worker_setting
from bsrun.inject import state
from bsrun.inject.import_hook import when_imported


def _install_torch_patches(torch):
    if state.config().enabled:
        from bsrun.inject import patches

        patches.install()
        state.debug("torch patches installed")
    else:
        _mark_ddp_workers(torch)
    if worker_setting(PROFILE_DIR_ENV):  # `bsrun profile`: its DDP construction hooks
        from bsrun.inject import record

        record.install_hooks()


def _mark_ddp_workers(torch) -> None:
    """--no-schedule: DDP stays DDP, but building one still makes this process a worker."""
    import torch.distributed as dist

    cls = torch.nn.parallel.DistributedDataParallel
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if dist.is_initialized():
            state.become_worker(dist.get_rank(), dist.get_world_size())
        original(self, *args, **kwargs)

    cls.__init__ = __init__


def _install_horovod_patches(hvd):
    """After horovod.torch has fully executed (torch, and so our torch patches, came first)."""
    if state.config().enabled:
        from bsrun.inject import horovod

        horovod.install()
        state.debug("horovod patches installed")
        return
    from horovod.torch import optimizer as hvd_optimizer

    original = hvd_optimizer.DistributedOptimizer

    @functools.wraps(original)
    def DistributedOptimizer(*args, **kwargs):
        state.become_worker(hvd.rank(), hvd.size())
        return original(*args, **kwargs)

    hvd.DistributedOptimizer = hvd_optimizer.DistributedOptimizer = DistributedOptimizer


def _start_worker(rank: int, world_size: int) -> None:
    """This process just became rank `rank` of `world_size`: its services start."""
    os.environ[WORKER_PID_ENV] = str(os.getpid())  # its children are not workers by their environment
    state.debug(f"worker {rank} of {world_size} in pid {os.getpid()}")
    from bsrun.inject import heartbeat

    heartbeat.start(rank)
    mp = sys.modules.get("multiprocessing")
    if mp is not None and mp.parent_process() is not None:  # a forked child leaves by os._exit
        from multiprocessing import util

        util.Finalize(None, _report_at_exit, exitpriority=0)
    if worker_setting(TRIAL_OUT_ENV):  # a `bsrun tune` trial: time the steps, end the job
        from bsrun.inject import trial

        trial.install(rank)
        state.debug("tuning trial installed")
    if worker_setting(PROFILE_DIR_ENV):  # `bsrun profile`: record spans, end at its last step
        when_imported("torch", lambda _torch: _start_recorder(rank))


def _start_recorder(rank: int) -> None:
    from bsrun.inject import record

    record.start(rank)
    state.debug("profile recorder installed")


def _report_at_exit() -> None:
    """Registered first, so it runs last: after the patches' exit flush has counted the last round."""
    if state.is_worker():
        from bsrun.inject import report

        report.write_rank_report(state.worker_rank())


def start():
    state.debug(f"bootstrap in pid {os.getpid()}")
    atexit.register(_report_at_exit)
    state.on_worker(_start_worker)
    when_imported("torch", _install_torch_patches)
    when_imported("horovod.torch", _install_horovod_patches)
    if str(os.getppid()) == worker_setting(LAUNCHER_PID_ENV):
        from bsrun.inject import heartbeat

        heartbeat.watch_launcher()
    rank = state.env_rank()
    if rank is not None and not worker_setting(WORKER_PID_ENV):  # a launcher's rank, not a worker's child's
        state.become_worker(rank, state.world_size() or 1)
