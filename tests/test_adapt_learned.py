"""Online adaptation's learned point, carried to the job's next launch.

When an adapted run settles, the launcher commits the point rank 0 kept to the job's entry
of `.bsrun/tuned.json` (under "adapted"); the next launch of the same job (same command,
same folder) says "bsrun: adapting from the point the last run kept (...)" and rank 0's
search starts there instead of at the configured point, still trying the configured one.

Every launch here is real: `bsrun -np 2 python tests/workers/adapt_train.py` on gloo,
one thread per rank, in the test's own folder. Which point a run keeps is the feature's
timing decision, so nothing here hard-codes it: every check compares with what the run
summary (`.bsrun/last-run.json`) and tuned.json say.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import WORKERS, assert_same_state, assert_scheduled, last_run, run_bsrun

from bsrun.config import LEARNED_KEY
from bsrun.sched.adaptive import MAX_RACE_WINDOWS, SEARCH_STEPS, WARMUP_STEPS, WINDOW, describe_point

# Long enough for a search from a learned point to reach every candidate it queues (the
# incumbent at step WARMUP_STEPS, then up to three candidates a window each: switches at 6,
# 10 and 14), to race them for MAX_RACE_WINDOWS windows and to keep one (by step
# SEARCH_STEPS, 98).
STEPS = SEARCH_STEPS
assert STEPS == WARMUP_STEPS + (4 + MAX_RACE_WINDOWS) * WINDOW
LEARNED_LINE = "bsrun: adapting from the point the last run kept ("
START_WHY = "explore: timing the starting point"
USER_PARTITION = 3_000_000  # "3MB": never a point adaptation picks (powers of two, 4 MiB, 25 MiB)


def launch(workdir, flags, out="sched"):
    """`bsrun FLAGS --timeout 60 -np 2 python adapt_train.py --opt sgd --steps STEPS --out
    WORKDIR/OUT` in workdir: ({rank: saved state}, the run summary, bsrun's stderr). The
    same `out` is the same command, so the same job (its entry of tuned.json)."""
    proc = run_bsrun([*flags, "--timeout", "60", "-np", 2, "python", WORKERS / "adapt_train.py", "--opt", "sgd",
                      "--steps", STEPS, "--out", workdir / out], cwd=workdir, timeout=180)
    assert proc.returncode == 0, (f"bsrun {' '.join(flags)} ... adapt_train.py exited {proc.returncode}"
                                  f"\n--- stderr (tail)\n{proc.stderr[-3000:]}")
    saved = {r: workdir / f"{out}-rank{r}.pt" for r in (0, 1)}
    assert all(p.exists() for p in saved.values()), f"adapt_train.py did not save both ranks' states: {saved}"
    states = {r: torch.load(p) for r, p in saved.items()}
    for p in saved.values():  # the next launch of the same command must write them anew
        p.unlink()
    return states, last_run(workdir), proc.stderr


def adapt(summary: dict, rank: int) -> dict:
    entry = next(r for r in summary["ranks"] if r["rank"] == rank)
    assert "adapt" in entry, f"rank {rank}'s summary has no 'adapt': {sorted(entry)}"
    return entry["adapt"]


def show(switches: list[dict]) -> str:
    return "\n".join(f"  step {s['step']:>3}: {s['why'][:60]:<60} {s['point']}" for s in switches) or "  (none)"


def learned_entry(workdir) -> dict:
    """The one job's "adapted" entry in tuned.json (every launch here is the same job)."""
    path = workdir / ".bsrun" / "tuned.json"
    assert path.exists(), "no .bsrun/tuned.json after a settled adapted run"
    jobs = json.loads(path.read_text())["jobs"]
    assert len(jobs) == 1, f"expected one job in tuned.json, got {list(jobs)}"
    entry = next(iter(jobs.values()))
    assert LEARNED_KEY in entry, f"the job's entry has no {LEARNED_KEY!r}: {entry}"
    return entry[LEARNED_KEY]


def start_point(summary: dict, context: str) -> dict:
    """Where rank 0's search started (its first decision times the starting point); rank 1
    switched to the same point at the same step."""
    first = [adapt(summary, r)["switches"][:1] for r in (0, 1)]
    assert first[0] and first[0][0]["why"] == START_WHY and first[0][0]["step"] == WARMUP_STEPS, \
        f"rank 0's first decision is not {START_WHY!r} at step {WARMUP_STEPS}:\n" \
        f"{show(adapt(summary, 0)['switches'])}\n{context}"
    assert first[1] and (first[1][0]["step"], first[1][0]["point"]) == (first[0][0]["step"], first[0][0]["point"]), \
        f"rank 1 did not start at rank 0's point: {first}"
    return first[0][0]["point"]


@pytest.mark.slow
def test_the_point_a_run_kept_is_where_the_next_launch_of_the_job_starts(workdir):
    """Five launches of one job (`adapt_train.py --opt sgd`, 58 steps of a 12.6 MB MLP), in one folder.

    1. With default knobs: the run settles, and tuned.json's "adapted" point is exactly
       the point rank 0's summary says it kept (its "decisions": rank 0's switch count).
    2. The same command again: bsrun prints "adapting from the point the last run kept
       (<that point>, ...)", rank 0's first decision ("explore: timing the starting point",
       at step WARMUP_STEPS) carries exactly that point on both ranks, the search still
       tries the configured point (run 1's start) when the kept one differs from it, both
       ranks run scheduled, and both end with exactly the parameters, optimizer state,
       gradients and losses of the same script under `--no-schedule` (rtol 1e-5).
    3. `--no-adapt`: no such line, adapt "off" (why "--no-adapt") with no switch, on the
       configured point (not the learned one), and tuned.json's learned point unchanged.
    4. `--partition 3MB`: the line (saying the partition is as given), and the start point
       is the learned one (as tuned.json held it before the launch) with the user's
       partition; every point tried keeps it; tuned.json's learned point is unchanged.
    Whether run 1 kept the configured point or another is the feature's timing decision:
    every check compares with what the summaries and tuned.json say."""
    plain, plain_summary = launch(workdir, ["--no-schedule"], out="plain")[:2]
    assert {r.get("mode") for r in plain_summary["ranks"]} == {"off"}, plain_summary["ranks"]

    # 1. a first adapted run of the job settles and its kept point is committed
    first, summary, err = launch(workdir, [])
    assert LEARNED_LINE not in err, f"a first launch said it adapts from a learned point:\n{err[-2000:]}"
    assert_scheduled(summary, context=err[-2000:])
    a0 = adapt(summary, 0)
    listing = show(a0["switches"])
    assert a0["state"] == "settled", f"run 1 ended {a0['state']!r}, not settled, in {STEPS} steps:\n{listing}"
    configured, kept = start_point(summary, err[-2000:]), a0["point"]
    assert adapt(summary, 1)["point"] == kept, f"the ranks ended on different points: {adapt(summary, 1)}"
    learned = learned_entry(workdir)
    assert learned["point"] == kept, \
        f"tuned.json holds {learned['point']}, not the point rank 0 kept {kept}:\n{listing}"
    assert learned.get("decisions") == len(a0["switches"]), learned
    for r in (0, 1):
        assert_same_state(first[r], plain[r], f"run 1, rank {r}")
    print(f"run 1 started at {configured}, kept {kept}"
          f"{' (the configured point)' if kept == configured else ''}:\n{listing}")

    # 2. the same command again: it starts from the kept point, and stays exact
    second, summary, err = launch(workdir, [])
    assert f"{LEARNED_LINE}{describe_point(kept)}" in err, \
        f"no '{LEARNED_LINE}{describe_point(kept)}, ...' line:\n{err[-2000:]}"
    assert_scheduled(summary, context=err[-2000:])
    start = start_point(summary, err[-2000:])
    listing = show(adapt(summary, 0)["switches"])
    assert start == kept, f"run 2 started at {start}, not at run 1's kept point {kept}:\n{listing}"
    if kept != configured:  # a learned incumbent: the configured point is still one candidate
        tried = [s["point"] for s in adapt(summary, 0)["switches"] if s["why"].startswith("explore")]
        assert configured in tried, f"run 2 never tried the configured point {configured}:\n{listing}"
    for r in (0, 1):
        assert_same_state(second[r], plain[r], f"run 2, rank {r}")

    # 3. --no-adapt: no learned start, the configured point as given
    learned_before = learned_entry(workdir)
    _, summary, err = launch(workdir, ["--no-adapt"])
    assert LEARNED_LINE not in err, f"--no-adapt still said it adapts from the learned point:\n{err[-2000:]}"
    assert_scheduled(summary, context=err[-2000:])
    for r in (0, 1):
        off = adapt(summary, r)
        assert (off["state"], off["why_off"], off["switches"]) == ("off", "--no-adapt", []), f"rank {r}: {off}"
        assert off["point"] == configured, \
            f"rank {r} under --no-adapt ran {off['point']}, not the configured point {configured}"
    assert learned_entry(workdir) == learned_before, "a --no-adapt run changed the learned point"

    # 4. a knob the user gives stays the user's: the learned point, with the user's partition
    learned_point = learned_entry(workdir)["point"]
    _, summary, err = launch(workdir, ["--partition", "3MB"])
    assert LEARNED_LINE in err, f"no '{LEARNED_LINE}...' line with --partition given:\n{err[-2000:]}"
    assert_scheduled(summary, context=err[-2000:])
    start = start_point(summary, err[-2000:])
    listing = show(adapt(summary, 0)["switches"])
    assert start == {**learned_point, "partition": USER_PARTITION}, \
        f"with --partition 3MB run 4 started at {start}, not at the learned {learned_point} with the " \
        f"user's partition:\n{listing}"
    assert all(s["point"]["partition"] == USER_PARTITION for s in adapt(summary, 0)["switches"]), \
        f"a point tried with --partition 3MB had another partition:\n{listing}"
    assert "with partition as given" in err, f"the line does not say the partition is the user's:\n{err[-2000:]}"
    assert learned_entry(workdir) == learned_before, \
        "a run with --partition given replaced the learned point (its search was not free)"
