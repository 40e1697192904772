"""One tuning trial: one real launch of the user's job with a candidate config.

The trial is bsrun's own command line, `bsrun run [the user's launch flags] --partition
P --credit C COMMAND...`, started as a child process (bsrun.child, so it ends with the
tuner) with BSRUN_TRIAL_* in its environment: inside the workers
bsrun/inject/trial.py times K warm-up + S steps and ends the job at the same step on
every rank. So a trial runs exactly what a user runs, on the same emulated network,
and costs seconds. Its output goes to a log file per trial, next to the journal.

A trial that fails (a rank's exit code), hangs (longer than the trial timeout: it is
stopped as Ctrl-C would stop it), ends before its steps are done, or runs unscheduled
comes back with status "failed" or "timeout" and one sentence of reason.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from bsrun import child
from bsrun.config import TRIAL_ID_ENV, TRIAL_OUT_ENV, TRIAL_STEPS_ENV, TRIAL_WARMUP_ENV
from bsrun.launch.summary import read_last_run

TEARDOWN_S = 30.0  # after its workers' grace: time bsrun may take to remove its network
_ERROR_LINE = re.compile(r"^(\[\d+\] )?(\[rank\d+\]: )?(\w+(Error|Exception|Interrupt)|bsrun: error)\b.*")
REASON_CHARS = 240  # of a worker's error line; the trial's log has all of it


@dataclass
class TrialSetup:
    """Everything each trial of one tuning run shares."""

    bsrun_args: list[str]  # the user's launch flags: -np, --emulate-bandwidth, fixed knobs, ...
    command: list[str]
    warmup: int
    steps: int
    timeout_s: float
    grace_s: float  # the launch's --grace: how long stopping its workers may take
    log_dir: Path

    def trial_args(self, config: dict[str, str]) -> list[str]:
        """A trial's bsrun arguments: `run [launch flags] --KNOB VALUE... COMMAND`."""
        knobs = [a for name, value in config.items() for a in (f"--{name}", value)]
        return self.job_args(["run"], knobs)

    def job_args(self, subcommand: list[str], knobs: list[str] = ()) -> list[str]:
        """`SUBCOMMAND [launch flags] [knobs] COMMAND`: bsrun's arguments for this job."""
        return [*subcommand, *self.bsrun_args, *knobs, *self.command]

    @property
    def stop_grace_s(self) -> float:
        """How long stopping a launch may take: its workers' grace, then its network's teardown."""
        return self.grace_s + TEARDOWN_S


@dataclass
class Outcome:
    status: str  # ok, failed, timeout
    reason: str | None = None
    step_times: list[float] = field(default_factory=list)
    worker: dict = field(default_factory=dict)  # what rank 0 measured and ran with
    duration_s: float = 0.0
    log: str = ""

    def record(self) -> dict:
        """The measurement part of a journal record."""
        rec = {"status": self.status, "reason": self.reason, "duration_s": round(self.duration_s, 2),
               "log": self.log, "step_times": self.step_times, "mode": self.worker.get("mode")}
        if self.step_times:
            median = statistics.median(self.step_times)
            q = statistics.quantiles(self.step_times, n=4) if len(self.step_times) > 1 else [median] * 3
            rec.update(step_s=median, score=1.0 / median, spread=[q[0], q[2]],
                       ran_with={k: self.worker.get(k) for k in ("partition", "credit_bytes", "world_size")})
        return rec


def _why_failed(log_text: str) -> str:
    """The launcher's one line about the failure, with the failed worker's exception."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    launcher = next((line for line in reversed(lines) if "failed with exit code" in line
                     or line.startswith("bsrun: error")), None)
    rank = re.search(r"rank (\d+) failed", launcher or "")
    errors = [line for line in lines if _ERROR_LINE.match(line) and line != launcher]
    own = [line for line in errors if rank and line.startswith(f"[{rank.group(1)}] ")]
    cause = (own or errors or [None])[-1]
    if cause and len(cause) > REASON_CHARS:
        cause = cause[:REASON_CHARS - 3] + "..."
    parts = [p.removeprefix("bsrun: ") for p in (launcher, cause) if p]
    return "; ".join(parts) if parts else (lines[-1] if lines else "no output")


def _steps_reached(since: float) -> tuple[int | None, str | None]:
    """Rank 0's step count and mode from the run summary this trial's launch wrote."""
    run = read_last_run(since=since)
    r0 = min(run["ranks"], key=lambda r: r["rank"], default={}) if run else {}
    return r0.get("steps"), r0.get("mode")


def run_trial(setup: TrialSetup, number: int, config: dict[str, str]) -> Outcome:
    """Launch the job once with `config`; never raises for the job's own failures.

    Ctrl-C or SIGTERM of the tuner (KeyboardInterrupt here) stops the launch first.
    """
    setup.log_dir.mkdir(parents=True, exist_ok=True)
    log_path, out = setup.log_dir / f"trial-{number}.log", setup.log_dir / f"trial-{number}.json"
    out.unlink(missing_ok=True)
    trial_env = {TRIAL_OUT_ENV: str(out.resolve()), TRIAL_WARMUP_ENV: str(setup.warmup),
                 TRIAL_STEPS_ENV: str(setup.steps), TRIAL_ID_ENV: str(number)}
    started = time.time()
    with open(log_path, "w") as log:
        code = child.run(setup.trial_args(config), setup.timeout_s, setup.stop_grace_s, extra_env=trial_env,
                         log=log).code
    outcome = Outcome("failed", duration_s=time.time() - started, log=str(log_path))
    text = log_path.read_text(errors="replace")
    if code is None:
        outcome.status = "timeout"
        outcome.reason = f"did not finish within {setup.timeout_s:g} s (hung?) and was stopped"
    elif code != 0:
        outcome.reason = f"exited with code {code}: {_why_failed(text)}"
    elif not out.exists():
        steps, mode = _steps_reached(started)
        needed = setup.warmup + setup.steps
        if not steps:
            outcome.reason = (f"the job never stepped under bsrun (mode {mode or 'unknown'}); a trial "
                              f"needs {needed} optimizer steps of a scheduled model")
        else:
            outcome.reason = (f"the job ended after {steps} optimizer steps, before the trial's {needed} "
                              f"({setup.warmup} warm-up + {setup.steps} timed)")
    else:
        try:
            outcome.worker = json.loads(out.read_text())
            out.unlink()
        except (OSError, ValueError) as e:
            outcome.reason = f"left an unreadable measurement ({e})"
            return outcome
        if outcome.worker.get("mode") != "scheduled":
            outcome.reason = (f"ran as {outcome.worker.get('mode')}, not scheduled: partition and credit "
                              f"have no effect on this job")
        else:
            outcome.status = "ok"
            outcome.step_times = [float(t) for t in outcome.worker["step_times"]]
    return outcome
