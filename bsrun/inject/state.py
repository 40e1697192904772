"""This worker process's bsrun state: who it is, its config, and what it has done so far.

A leaf (the standard library and bsrun.config only; no torch), so every other module of
inject/ can read and report through it without importing the modules that do the work:
whether and since when this process is a data-parallel worker (`become_worker`: its rank
and world size from then on, and the callbacks that start a worker's services), the
config resolved once, the notes users see once, the
counters of the run summary, the models being scheduled (their ModelRuntime objects,
by duck type: `index`, `flush()`, `close()`, `counters()`), the step listeners and the
profile recorder's slot.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref

from bsrun.config import DEBUG_ENV, SchedConfig, worker_setting

RANK_VARIABLES = ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
SIZE_VARIABLES = ("WORLD_SIZE", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")

MODELS: weakref.WeakSet = weakref.WeakSet()  # every ModelRuntime of this process
STEP_LISTENERS: list = []  # callables(step_number), run after each optimizer step() returns
recorder = None            # while `bsrun profile` records: its Recorder (bsrun/inject/record.py)
_NOTES: list[str] = []
_COUNTS = {"mode": "off", "steps": 0}
_CONFIG: list[SchedConfig] = []
_WORKER: list[tuple[int, int]] = []  # (rank, world size) once this process is a worker
_ON_WORKER: list = []                # callables(rank, world_size), run when it becomes one
_WORKER_LOCK = threading.Lock()


def _first_number(names, env):
    for name in names:
        value = env.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return None


def env_rank(env=os.environ):
    """The rank a launcher gave this process in its environment (torchrun, Horovod, MPI), or None."""
    return _first_number(RANK_VARIABLES, env)


def worker_rank(env=os.environ):
    """This worker's global rank; before it became one, the rank its environment names (or None)."""
    return _WORKER[0][0] if _WORKER else env_rank(env)


def world_size(env=os.environ):
    """The number of workers of its job; before it became a worker, the environment's (or None)."""
    return _WORKER[0][1] if _WORKER else _first_number(SIZE_VARIABLES, env)


def is_worker() -> bool:
    return bool(_WORKER)


def on_worker(callback) -> None:
    """Run callback(rank, world_size) when this process becomes a worker (now, if it is one)."""
    with _WORKER_LOCK:
        _ON_WORKER.append(callback)
        now = list(_WORKER)
    if now:
        _run_worker_callback(callback, *now[0])


def become_worker(rank: int, world_size: int) -> bool:
    """This process is rank `rank` of `world_size` data-parallel workers from now on: where it
    builds a DDP model or an hvd.DistributedOptimizer (or starts with a launcher's rank).
    The first call counts; it runs the on_worker callbacks. True if this call made it one."""
    with _WORKER_LOCK:
        if _WORKER:
            if _WORKER[0] != (rank, world_size):
                debug(f"already worker {_WORKER[0][0]} of {_WORKER[0][1]}; ignoring rank {rank} of {world_size}")
            return False
        _WORKER.append((int(rank), int(world_size)))
        callbacks = list(_ON_WORKER)
    for callback in callbacks:
        _run_worker_callback(callback, int(rank), int(world_size))
    return True


def _run_worker_callback(callback, rank: int, size: int) -> None:
    try:
        callback(rank, size)
    except Exception as e:  # never break the user's model because of bsrun's services
        print(f"bsrun: rank {rank}: warning: could not start {getattr(callback, '__name__', callback)}: {e!r}",
              file=sys.stderr, flush=True)


def config() -> SchedConfig:
    """The config the launcher exported, resolved once for the whole process."""
    if not _CONFIG:
        _CONFIG.append(SchedConfig.from_env())
    return _CONFIG[0]


def debug(message: str) -> None:
    if worker_setting(DEBUG_ENV) == "1":
        print(f"bsrun[{worker_rank()}]: {message}", file=sys.stderr, flush=True)


# --- what users are told ------------------------------------------------------------------


def say_once(message: str) -> None:
    """A note users see once per run (and in the run summary)."""
    if message not in _NOTES:
        _NOTES.append(message)
        if (worker_rank() or 0) == 0:
            print(f"bsrun: {message}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    """A note from this rank, whatever its rank (say_once speaks for all from rank 0)."""
    if message not in _NOTES:
        _NOTES.append(message)
        print(f"bsrun: rank {worker_rank()}: {message}", file=sys.stderr, flush=True)


def failed(message: str) -> str:
    """The reason this rank is about to fail, kept for the run summary's failure line."""
    _COUNTS["error"] = message
    return f"bsrun: {message}"


# --- what the run summary counts --------------------------------------------------------


def set_mode(mode: str) -> None:
    """scheduled > fallback > off: the run summary reports the most scheduled model."""
    order = ("off", "fallback", "scheduled")
    if order.index(mode) > order.index(_COUNTS["mode"]):
        _COUNTS["mode"] = mode


def withdraw(model) -> None:
    """A scheduled model that became plain DDP before its first round."""
    MODELS.discard(model)
    if not MODELS:
        _COUNTS["mode"] = "fallback"


def note_if_nothing_scheduled() -> None:
    """A distributed script that stepped an optimizer but built nothing bsrun schedules."""
    if _COUNTS["mode"] == "off" and _COUNTS["steps"] and _WORKER and _WORKER[0][1] > 1:
        say_once("nothing was scheduled: this script built no DistributedDataParallel model "
                 "and no hvd.DistributedOptimizer, so its communication ran as written")


def count_step() -> int:
    """Called at each optimizer step(); returns its number (1 for the first)."""
    _COUNTS["steps"] += 1
    return _COUNTS["steps"]


def step_finished(number: int) -> None:
    """After step() number `number` returned to the script's side of bsrun."""
    for listener in list(STEP_LISTENERS):
        listener(number)


def counters() -> dict:
    """This rank's part of the run summary: its models' counters, mode, steps and notes."""
    stats = {"tasks": 0, "partitions": 0, "bytes": 0, "rounds": 0, "negotiations": 0, "replayed_rounds": 0,
             "ddp_rounds": 0, "checks": 0}
    for model in list(MODELS):
        for key, value in model.counters().items():
            stats[key] += value
    adapt = next((model.adapter.report() for model in list(MODELS)), None)  # the first model's
    return {**stats, **_COUNTS, "notes": list(_NOTES), **({"adapt": adapt} if adapt is not None else {})}


# --- the scheduled models ---------------------------------------------------------------


def model_of(params):
    """The ModelRuntime that schedules any of these parameters, or None."""
    ids = {id(p) for p in params}
    for model in list(MODELS):
        if ids & model.index.keys():
            return model
    return None


def agreed_sizes() -> tuple[int, int]:
    """Partition and credit in bytes as rank 0 agreed them for this process's models (the
    first that agreed), or the config's before any model has: what a run reports."""
    for model in list(MODELS):
        if model.layout is not None:
            return model.partition_bytes, model.credit_bytes
    return config().partition, config().credit_bytes


def flush_all() -> None:
    """Every model's scheduled communication finished and its updates applied."""
    for model in list(MODELS):
        model.flush()


def close_all() -> None:
    for model in list(MODELS):
        model.close()
