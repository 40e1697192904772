"""Runs first in every worker Python process of a bsrun launch.

It decides whether this process is a training worker (it has a rank from torchrun,
Horovod or MPI), and if so arranges for the patches to be installed as soon as the
script imports torch (a post-import hook, so processes that never import torch pay
nothing), and for the rank's part of the run summary to be written at exit.
"""

import atexit
import importlib.abc
import os
import sys

from bsrun.config import DEBUG_ENV, PROFILE_DIR_ENV, TRIAL_OUT_ENV, WORKER_PID_ENV, worker_setting

RANK_VARIABLES = ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
SIZE_VARIABLES = ("WORLD_SIZE", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def _first_number(names, env):
    for name in names:
        value = env.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return None


def worker_rank(env=os.environ):
    """This process's global rank, or None when it is not a training worker."""
    return _first_number(RANK_VARIABLES, env)


def world_size(env=os.environ):
    """The number of workers its launcher started, or None when not a training worker."""
    return _first_number(SIZE_VARIABLES, env)


def debug(message: str) -> None:
    if worker_setting(DEBUG_ENV) == "1":
        print(f"bsrun[{worker_rank()}]: {message}", file=sys.stderr, flush=True)


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Calls `callback(module)` right after `name` has been imported, once."""

    def __init__(self, name, callback):
        self.name = name
        self.callback = callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        loader, callback = spec.loader, self.callback

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                callback(module)

        spec.loader = _Loader()
        return spec


def when_imported(name, callback):
    """Run callback(module) now if `name` is already imported, else right after its import."""
    if name in sys.modules:
        callback(sys.modules[name])
    else:
        sys.meta_path.insert(0, _PostImportHook(name, callback))


def _install_torch_patches(_torch):
    from bsrun.inject import patches

    patches.install()
    debug("torch patches installed")
    if worker_setting(TRIAL_OUT_ENV):  # a `bsrun tune` trial: time the steps, end the job
        from bsrun.inject import trial

        trial.install(worker_rank())
        debug("tuning trial installed")
    if worker_setting(PROFILE_DIR_ENV):  # `bsrun profile`: record spans, end at its last step
        from bsrun.inject import record

        record.install(worker_rank())
        debug("profile recorder installed")


def _install_horovod_patches(_hvd_torch):
    """After horovod.torch has fully executed (torch, and so our torch patches, came first)."""
    from bsrun.inject import horovod

    horovod.install()
    debug("horovod patches installed")


def start():
    rank = worker_rank()
    if rank is None or worker_setting(WORKER_PID_ENV):
        return  # not a worker, or a child (data loader, subprocess) of one
    os.environ[WORKER_PID_ENV] = str(os.getpid())
    debug(f"bootstrap in pid {os.getpid()}")
    when_imported("torch", _install_torch_patches)
    when_imported("horovod.torch", _install_horovod_patches)
    from bsrun.inject import heartbeat, report

    heartbeat.start(rank)
    atexit.register(report.write_rank_report, rank)
