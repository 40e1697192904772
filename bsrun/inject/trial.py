"""One tuning trial, inside each worker: time the steady state, then end the job.

`bsrun tune` launches the user's job with BSRUN_TRIAL_OUT set (and the number of
warm-up and timed steps). Every rank counts the same optimizer steps (a
`runtime.STEP_LISTENERS` entry, called after each `step()` returns). After K warm-up
steps rank 0 times the next S steps: a step is the time between two consecutive
`step()` returns, so the communication a scheduled step leaves in flight, which the
next forward pass waits for, counts in the next step. At step K + S every rank:

1. `runtime.flush_all()`: the last step's scheduled communication finishes everywhere
   and every pending update is applied;
2. waits for the others (`dist.barrier()` where torch.distributed is initialised,
   `hvd.barrier()` under Horovod): no rank leaves while another is still in a
   collective, and rank 0, which hosts the rendezvous store, leaves last or together;
3. rank 0 writes the measurement atomically to BSRUN_TRIAL_OUT;
4. raises SystemExit(0) out of `optimizer.step()`.

Why SystemExit and not `os._exit`: the script's `finally` blocks and atexit handlers
still run (`destroy_process_group`, DataLoader workers, bsrun's own run report), code
after the training loop (a final evaluation, saving a checkpoint over the real one)
does not, and the launcher sees exit code 0 on every rank. A script may swallow
SystemExit (a bare `except:` around its loop), so two guards end the process anyway:
a `step()` after the end step, or a process still alive EXIT_GRACE_S after the end,
writes the run report and leaves with `os._exit(0)`.

If the job ends before step K + S, or never steps under bsrun, nothing is written and
`bsrun tune` records the trial as failed, with the step count from the run report.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time

from bsrun.config import (TRIAL_ID_ENV, TRIAL_OUT_ENV, TRIAL_STEPS_ENV, TRIAL_WARMUP_ENV, SchedConfig,
                          worker_setting)
from bsrun.fsutil import atomic_write_json

EXIT_GRACE_S = 30.0  # after the end step, a process still alive is ended


class Trial:
    def __init__(self, rank: int, warmup: int, steps: int, out: str):
        self.rank, self.warmup, self.steps, self.out = rank, warmup, steps, out
        self.end = warmup + steps
        self.boundaries: list[float] = []  # step() returns K, K+1, ..., K+S

    def on_step(self, number: int) -> None:
        if number > self.end:
            _hard_exit(self.rank)  # the script caught our SystemExit and went on training
        if number >= self.warmup:
            self.boundaries.append(time.perf_counter())
        if number == self.end:
            self.finish()

    def finish(self) -> None:
        from bsrun.inject import runtime

        runtime.flush_all()
        _barrier()
        if self.rank == 0:
            atomic_write_json(self.out, self.result(runtime.counters()))
        watchdog = threading.Timer(EXIT_GRACE_S, _hard_exit, args=(self.rank,))
        watchdog.daemon = True
        watchdog.start()
        raise SystemExit(0)

    def result(self, counters: dict) -> dict:
        times = [b - a for a, b in zip(self.boundaries, self.boundaries[1:])]
        median = statistics.median(times)
        config = SchedConfig.from_env()
        return {"trial": worker_setting(TRIAL_ID_ENV), "warmup": self.warmup, "steps": self.steps,
                "step_times": times, "median_step_s": median, "steps_per_s": 1.0 / median,
                "mode": counters["mode"], "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                "partition": config.partition, "credit_bytes": config.credit_bytes}


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        return
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None and hvd.is_initialized():
        hvd.barrier()


def _hard_exit(rank: int) -> None:
    from bsrun.inject import report

    report.write_rank_report(rank)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def install(rank: int) -> None:
    """Count this worker's steps for the trial that BSRUN_TRIAL_* describe."""
    from bsrun.inject import runtime

    trial = Trial(rank, int(worker_setting(TRIAL_WARMUP_ENV) or 3), int(worker_setting(TRIAL_STEPS_ENV) or 10),
                  worker_setting(TRIAL_OUT_ENV))
    runtime.STEP_LISTENERS.append(trial.on_step)
