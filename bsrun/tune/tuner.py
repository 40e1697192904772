"""`bsrun tune`: ask, launch, measure, tell, append to the journal; then recheck and commit.

    search:  `trials` launches; the first is bsrun's defaults, the next come from the
             Gaussian process (search.py), each one journal record
    recheck: the best `recheck` configs (the defaults among them) launched once more
    commit:  the one fastest again goes to .bsrun/tuned.json (commit.py)

Everything is decided from the journal, so a run that was stopped (Ctrl-C, SIGTERM,
SIGKILL) resumes when the same command runs again, and a journal that is complete just
commits again. `grid` measures every point of a log-spaced grid over the same space
with the same trials, for judging the tuner (BENCHMARKS.md); it commits nothing.

Ctrl-C or SIGTERM unwinds through the running trial, which stops its launch, as
bsrun.signals.Stopped; the journal holds every finished trial. This process never
imports torch: the workers it measures get every core.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bsrun.errors import BsrunError
from bsrun.signals import StopSignals
from bsrun.tune import presim, search
from bsrun.tune.commit import commit
from bsrun.tune.journal import Journal, journal_path, read_records, TUNE_DIR
from bsrun.tune.progress import Progress, describe_config, say, trials_table
from bsrun.tune.space import Space
from bsrun.tune.trial import TrialSetup, run_trial


@dataclass
class Job:
    """The job being tuned: what its signature is made of, and how to launch a trial."""

    signature: str
    command: list[str]
    world_size: int
    hosts: list[str]
    setup: TrialSetup

    def header(self, space: Space) -> dict:
        return {"signature": self.signature, "command": self.command, "world_size": self.world_size,
                "hosts": self.hosts, "space": space.describe(), "launch_flags": self.setup.bsrun_args}


def _run(journal: Journal, job: Job, progress: Progress, kind: str, config: dict, **extra) -> dict:
    number = journal.next_number()
    progress.start(number, kind, config)
    outcome = run_trial(job.setup, number, config)
    record = {"type": "trial", "n": number, "kind": kind, "config": config, "warmup": job.setup.warmup,
              "steps": job.setup.steps, **extra, **outcome.record()}
    journal.append(record)
    progress.finish(record)
    return record


def _open(job: Job, space: Space, fresh: bool, console) -> Journal:
    path = journal_path(job.signature)
    journal = Journal.open(path, job.header(space), fresh=fresh)
    done = len(journal.trials())
    if done:
        say(console, f"bsrun: resuming from {path}: {done} trial(s) already measured")
    return journal


def _spread(values: list[float]) -> list[float] | None:
    return [min(values), max(values)] if values else None


def _proposals(journal: Journal, job: Job, space: Space, count: int, console) -> list[dict]:
    """--presim's first points: from the journal when resuming, else from one profile."""
    record = next((r for r in journal.records if r.get("type") == "presim"), None)
    if record is None:
        say(console, "bsrun: --presim: profiling the job once; its what-if replay proposes the first points")
        record = presim.propose(job.setup, space, count)
        journal.append(record)
        if record["configs"]:
            say(console, "bsrun: --presim proposes " + "; ".join(
                f"{describe_config(c)} ({t:.3g} s predicted)" for c, t in zip(record["configs"], record["predicted_s"])))
        else:
            say(console, f"bsrun: --presim proposes nothing ({record['reason']}); the search starts as without it")
    return record["configs"]


def tune(job: Job, space: Space, trials: int, recheck: int, fresh: bool, seed: int, console,
         use_presim: bool = False) -> dict:
    """Search, recheck, commit; returns what was committed (for --json and the caller)."""
    journal = _open(job, space, fresh, console)
    proposed = _proposals(journal, job, space, search.INITIAL_POINTS - 1, console) if use_presim else []
    planned = max(0, trials - len(journal.trials("search"))) + recheck
    with StopSignals(), Progress(console, journal, planned) as progress:
        while len(journal.trials("search")) < trials:
            config = search.next_config(space, journal.trials("search"), trials, seed, proposed)
            _run(journal, job, progress, "search", config)
        finalists = search.finalists(space, journal.trials("search"), recheck)
        for config in finalists:
            if not any(r["config"] == config for r in journal.trials("recheck")):
                _run(journal, job, progress, "recheck", config)
    searched = journal.trials("search", "recheck")
    best = search.winner(journal.trials("search"), journal.trials("recheck"), finalists)
    if best is None:
        raise BsrunError(f"no trial succeeded, nothing was committed; the reasons are in {journal.path} "
                         f"(`bsrun tune show`)", exit_code=1)
    mine, defaults = search.measurements(best, searched), search.measurements(space.defaults(), searched)
    details = {"command": job.command, "world_size": job.world_size, "hosts": job.hosts,
               "journal": str(journal.path), "step_s": statistics.median(mine), "measurements": mine,
               "spread": _spread(mine), "defaults": space.defaults(),
               "defaults_step_s": statistics.median(defaults) if defaults else None,
               "defaults_measurements": defaults}
    path = commit(job.signature, best, details)
    journal.append({"type": "commit", "config": best, **details})
    console.print(trials_table(journal.records, title=f"bsrun tune: {' '.join(job.command)}"))
    line = (f"bsrun: committed {describe_config(best)} to {path}: {details['step_s']:.4g} s/step "
            f"({1 / details['step_s']:.3g} steps/s), {_range(mine)} over {len(mine)} launch(es)")
    if defaults:
        line += (f"; defaults {details['defaults_step_s']:.4g} s ({_range(defaults)}): "
                 f"{details['defaults_step_s'] / details['step_s']:.3f}x")
    say(console, line)
    return {"committed": best, "tuned_file": str(path), **details}


def _range(values: list[float]) -> str:
    return f"{min(values):.4g}-{max(values):.4g} s"


def grid(job: Job, space: Space, fresh: bool, console) -> dict:
    """Measure every grid point not yet in the journal; report the fastest. Commits nothing."""
    journal = _open(job, space, fresh, console)
    points = [c for c in space.grid() if not any(r["config"] == c for r in journal.trials("grid"))]
    with StopSignals(), Progress(console, journal, len(points)) as progress:
        for config in points:
            _run(journal, job, progress, "grid", config)
    measured = [r for r in journal.trials("grid") if r["status"] == "ok"]
    console.print(trials_table(journal.records, title=f"bsrun tune --grid: {' '.join(job.command)}"))
    if not measured:
        raise BsrunError(f"no grid point succeeded; the reasons are in {journal.path}", exit_code=1)
    best = min(measured, key=lambda r: r["step_s"])
    say(console, f"bsrun: grid best {describe_config(best['config'])}: {best['step_s']:.4g} s/step "
                  f"({len(measured)} of {len(space.grid())} points measured)")
    return {"grid_best": best["config"], "step_s": best["step_s"], "journal": str(journal.path),
            "points": len(space.grid()), "measured": len(measured)}


def show(console, folder=TUNE_DIR) -> list[dict]:
    """Print every journal under `folder` as a table; returns {path, records} per journal."""
    shown = []
    for path in sorted(folder.glob("*.jsonl")) if folder.exists() else []:
        records = read_records(path, repair=False)
        if records is None:
            say(console, f"bsrun: {path} is corrupt; not shown")
            continue
        if not records:
            continue
        command = " ".join(records[0].get("command", []))
        console.print(trials_table(records, title=f"{path}: {command}"))
        shown.append({"journal": str(path), "records": records})
    if not shown:
        say(console, f"bsrun: no tuning journal in {folder}")
    return shown
