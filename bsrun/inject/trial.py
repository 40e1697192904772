"""One tuning trial, inside each worker: time the steady state, then end the job.

`bsrun tune` launches the user's job with BSRUN_TRIAL_OUT set (and the number of
warm-up and timed steps). Every rank counts the same optimizer steps (a
`state.STEP_LISTENERS` entry, called after each `step()` returns). After K warm-up
steps rank 0 times the next S steps: a step is the time between two consecutive
`step()` returns, so the communication a scheduled step leaves in flight, which the
next forward pass waits for, counts in the next step. At step K + S every rank ends the
job (bsrun/inject/ending.py: scheduled work finished, the ranks meet, SystemExit(0)),
rank 0 writing the measurement atomically to BSRUN_TRIAL_OUT just before. A script
that swallowed that SystemExit and steps again is ended with `ending.hard_exit`.

If the job ends before step K + S, or never steps under bsrun, nothing is written and
`bsrun tune` records the trial as failed, with the step count from the run report.
"""

from __future__ import annotations

import statistics
import time

from bsrun.config import TRIAL_ID_ENV, TRIAL_OUT_ENV, TRIAL_STEPS_ENV, TRIAL_WARMUP_ENV, worker_setting
from bsrun.fsutil import atomic_write_json
from bsrun.inject import ending, state


class Trial:
    def __init__(self, rank: int, warmup: int, steps: int, out: str):
        self.rank, self.warmup, self.steps, self.out = rank, warmup, steps, out
        self.end = warmup + steps
        self.boundaries: list[float] = []  # step() returns K, K+1, ..., K+S

    def on_step(self, number: int) -> None:
        if number > self.end:
            ending.hard_exit(self.rank)  # the script caught our SystemExit and went on training
        if number >= self.warmup:
            self.boundaries.append(time.perf_counter())
        if number == self.end:
            ending.end_job(self.rank, self.write_result if self.rank == 0 else None)

    def write_result(self) -> None:
        atomic_write_json(self.out, self.result(state.counters()))

    def result(self, counters: dict) -> dict:
        """What the tuner reads: the step times and the partition and credit agreed with rank 0."""
        times = [b - a for a, b in zip(self.boundaries, self.boundaries[1:])]
        median = statistics.median(times)
        partition, credit = state.agreed_sizes()
        return {"trial": worker_setting(TRIAL_ID_ENV), "warmup": self.warmup, "steps": self.steps,
                "step_times": times, "median_step_s": median, "steps_per_s": 1.0 / median,
                "mode": counters["mode"], "world_size": state.world_size() or 1,
                "partition": partition, "credit_bytes": credit}


def install(rank: int) -> None:
    """Count this worker's steps for the trial that BSRUN_TRIAL_* describe."""
    trial = Trial(rank, int(worker_setting(TRIAL_WARMUP_ENV) or 3), int(worker_setting(TRIAL_STEPS_ENV) or 10),
                  worker_setting(TRIAL_OUT_ENV))
    state.STEP_LISTENERS.append(trial.on_step)
