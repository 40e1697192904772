"""The bench's `replay` mode: a profile of bsrun-fixed replayed under a perfect schedule.

One repeat is a real `bsrun profile` launch of the bench worker as `bsrun-fixed` runs it;
the what-if model fitted to it is replayed by whatif.best_schedule (no cost per
collective or decision, the same compute, link and dependencies), and
whatif.gap_breakdown says where the gap to the profiled point goes. BENCHMARKS.md, "How
the bound is obtained", says what the estimate charges and what it does not. Torch-free,
like the runner.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bsrun.bench.launches import RunResult, profile_fixed
from bsrun.errors import BsrunError
from bsrun.profile import trace, whatif


def replay_once(model: str, nproc: int, bandwidth: str | None, steps: int, warmup: int, batch: int | None,
                cwd: Path, rep: int) -> RunResult:
    """The `replay` mode: `steps` profiled steps of bsrun-fixed after `warmup`, replayed
    under a perfect schedule (whatif.best_schedule); its step times are the replay's
    steady-state ones. The info keeps how well the replay of the profiled point itself
    matched the profiled run's steps, which is how far to trust the estimate, and the
    replay's account of the gap between the two (whatif.gap_breakdown)."""
    folder = cwd / f"replay-{model}-{bandwidth or 'loopback'}-{rep}"
    error = profile_fixed(folder, model, nproc, bandwidth, batch, cwd, warmup, steps)
    if error is not None:
        return RunResult("replay", error=f"the profile for the replay {error}")
    try:
        fitted = whatif.fit(trace.load(folder))
    except (BsrunError, ValueError, KeyError) as e:
        return RunResult("replay", error=f"the profile for the replay could not be fitted ({e})")
    best = whatif.best_schedule(fitted)
    breakdown = whatif.gap_breakdown(fitted, perfect_s=best["step_s"])
    steady = best["step_times_s"][len(best["step_times_s"]) // 2:]
    info = {"warmup": warmup, "profiled_step_s": fitted.profiled["measured_step_s"], "replayed_profiled_s": breakdown[-1][1],
            "breakdown": [list(row) for row in breakdown], "link_gbit_per_s": 8e-9 / fitted.beta if fitted.beta else None}
    return RunResult("replay", steady, info, launched_as="replayed")


def breakdown_line(where: str, rec: dict) -> str:
    """The replay's account of the gap from a perfect schedule to bsrun-fixed's point,
    each figure the median over the repeats."""
    rows = zip(*rec["replay_breakdown"])
    parts = [f"{rows_of[0][0]} {statistics.median(s for _, s in rows_of):.3f}" for rows_of in rows]
    measured = statistics.median(m for m, _ in rec["replay_self_check"])
    return f"{where}, from a perfect schedule to bsrun-fixed's point: {', '.join(parts)} s; measured {measured:.3f} s"
