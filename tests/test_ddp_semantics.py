"""DDP's semantics scheduled (issue 16): find_unused_parameters=True, Join with uneven inputs,
and optimizer closures at full overlap.

Each case runs a script from tests/workers/semantics_*.py on 2 real gloo ranks under
`bsrun --no-schedule` (plain DDP) and under `bsrun` with small partitions (4KiB, credit 2x),
and compares every rank's saved state (model, optimizer state, gradients, the losses the
script saw) with allclose(rtol=1e-5), and which gradients are None exactly: under DDP a
parameter unused on every rank keeps a None gradient (so Adam and weight decay leave it
alone). The run summary must show every rank scheduled with partitions > 0, so the
comparison is never against a fallback to plain DDP.
"""

import pytest
import torch

from conftest import (WORKERS, adapt_of, assert_same_state, assert_same_switches, assert_scheduled, last_run,
                      run_bsrun, show)

from bsrun.sched.adaptive import WARMUP_STEPS, WINDOW

SCHED = ["--partition", "4KiB", "--credit", "2x", "--timeout", "60"]
PLAIN = ["--no-schedule", "--timeout", "60"]
SYNCHRONISING = "synchronising fully"


def run(workdir, name, bsrun_args, script, args, timeout=240):
    """One `bsrun ARGS -np 2 python SCRIPT`; returns ({rank: saved state}, the run summary)."""
    out = workdir / name
    proc = run_bsrun([*bsrun_args, "-np", 2, "python", WORKERS / script, *args, "--out", out],
                     cwd=workdir, timeout=timeout)
    assert proc.returncode == 0, (f"bsrun {' '.join(map(str, bsrun_args))} ... {script} exited "
                                  f"{proc.returncode}\n--- stderr (tail)\n{proc.stderr[-3000:]}")
    saved = {r: workdir / f"{name}-rank{r}.pt" for r in (0, 1)}
    assert all(p.exists() for p in saved.values()), f"{script} did not save both ranks' states"
    return {r: torch.load(p) for r, p in saved.items()}, last_run(workdir)


def plain_and_scheduled(workdir, script, args, sched_args=SCHED):
    plain, plain_summary = run(workdir, "plain", PLAIN, script, args)
    assert {r.get("mode") for r in plain_summary["ranks"]} == {"off"}
    sched, summary = run(workdir, "sched", sched_args, script, args)
    assert_scheduled(summary)
    for r in (0, 1):
        assert sched[r]["grad_is_none"] == plain[r]["grad_is_none"], \
            f"rank {r}: which gradients are None differs from plain DDP"
        assert_same_state(compared(sched[r]), compared(plain[r]), f"rank {r}")
    return plain, sched, summary


def compared(saved):
    """All that a worker saved but what only bsrun has (its pending updates)."""
    return {k: v for k, v in saved.items() if k != "pending"}


@pytest.mark.slow
def test_find_unused_parameters_used_on_one_rank_on_none_and_under_no_sync(workdir):
    """find_unused_parameters=True, Adam with weight decay, 8 steps: `branch` runs on rank 0
    only (averaged with rank 1's zeros, its gradient created on rank 1), `dead` on no rank
    (its gradients stay None, Adam never steps it), `side` only in a no_sync micro-batch of
    rank 1 (globally used: rank 1's accumulated gradient averaged), a step with
    zero_grad(set_to_none=False), and a step where the script gives `dead.weight` a gradient
    of its own, different per rank, which DDP leaves untouched (not averaged)."""
    plain, _, _ = plain_and_scheduled(workdir, "semantics_unused.py", [])
    for r in (0, 1):
        none = plain[r]["grad_is_none"]
        assert none["dead.bias"] and not none["branch.weight"], \
            f"rank {r}: the plain run does not show DDP's unused-parameter semantics: {none}"
    ranks_apart = (plain[0]["model"]["dead.weight"] - plain[1]["model"]["dead.weight"]).abs().max()
    assert ranks_apart > 1e-3, "plain DDP should have stepped dead.weight with each rank's own gradient"


@pytest.mark.slow
def test_static_graph_leaves_the_gradients_of_parameters_no_rank_used_untouched(workdir):
    """DDP(static_graph=True) finds the unused parameters in its first iteration and treats
    them as find_unused_parameters does: `dead` keeps None gradients (Adam never steps it),
    `branch` (rank 0 only) is averaged with rank 1's zeros. bsrun used to all-reduce zeros
    into `dead`, and Adam's weight decay then moved it."""
    plain, _, _ = plain_and_scheduled(workdir, "semantics_unused.py", ["--static-graph", "--accumulate-step", "-1"])
    assert plain[0]["grad_is_none"]["dead.bias"], "the plain run does not leave dead's gradient None"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["context", "method"], ids=["Join([model])", "model.join()"])
def test_join_with_uneven_inputs(workdir, how):
    """Rank 0 has 5 batches, rank 1 has 3; SGD with momentum; BatchNorm's buffers broadcast
    before each forward (under Join from the highest rank not joined); after the loop the
    model of the last rank to join goes to every rank. Rank 1 shadows two rounds."""
    _, _, summary = plain_and_scheduled(workdir, "semantics_join.py", ["--how", how])
    rounds = {r["rank"]: r["rounds"] for r in summary["ranks"]}
    assert rounds == {0: 5, 1: 5}, f"rank 1 should have shadowed rank 0's last 2 rounds: {rounds}"


@pytest.mark.slow
@pytest.mark.parametrize("batches", ["5,3", "2,5"])
def test_join_with_find_unused_parameters(workdir, batches):
    """Both at once: a branch only rank 0 runs, find_unused_parameters=True, uneven inputs.
    2,5: rank 0, the branch's only user, joins first; DDP's joined rank keeps contributing
    the used map of its last round (its reducer's map, all-reduced in place), so the branch
    stays used: rank 1 gets zeros averaged into a created gradient and SGD's momentum keeps
    moving it. bsrun must do the same."""
    plain_and_scheduled(workdir, "semantics_join.py", ["--find-unused", "--batches", batches])


@pytest.mark.slow
@pytest.mark.parametrize("batches", ["24,13", "24,21"])
def test_join_adapts_until_a_rank_runs_out_and_stays_exact(workdir, batches):
    """Online adaptation under Join, in 4 KiB partitions (credit, order and proxy free): both
    ranks switch at the same steps while both train (at step 6 to the first candidate);
    in the first round after rank 1 ran out (step 14: at the sweep's end; step 22: in the
    race, or after the search if none was needed) every rank records the same last
    decision ("keep", naming Join), runs
    that point and stops adapting (off, why: Join); rank 1 shadows rank 0's remaining
    rounds in that point's layout. Model, optimizer state, gradients and losses are plain
    DDP's on both ranks."""
    _, _, summary = plain_and_scheduled(workdir, "semantics_join.py", ["--batches", batches],
                                        ["--partition", "4KiB", "--timeout", "60"])
    switches = assert_same_switches(summary)
    listing = show(switches)
    joined_at = int(batches.split(",")[1]) + 1
    first_window = [s for s in switches if s["step"] == WARMUP_STEPS + WINDOW]
    assert first_window and first_window[0]["point"] != switches[0]["point"], \
        f"no switch to a candidate at step {WARMUP_STEPS + WINDOW}:\n{listing}"
    last = switches[-1]
    assert last["step"] == joined_at and last["why"].startswith("keep") and "Join" in last["why"], \
        f"no last decision at step {joined_at}, the first round after rank 1 ran out:\n{listing}"
    for r in (0, 1):
        adapt = adapt_of(summary, r)
        assert adapt["state"] == "off" and adapt["why_off"].startswith("Join"), f"rank {r}: {adapt}"
        assert adapt["point"] == last["point"], f"rank {r} runs {adapt['point']}, not the last decision's:\n{listing}"
    rounds = {r["rank"]: r["rounds"] for r in summary["ranks"]}
    assert rounds == {0: 24, 1: 24}, f"rank 1 should have shadowed rank 0's last rounds: {rounds}"


@pytest.mark.slow
def test_join_throw_on_early_termination(workdir):
    """join(throw_on_early_termination=True): rank 0's 4th forward and rank 1's exit from
    the context raise Join's RuntimeError on both ranks, after the same 3 steps as DDP."""
    plain, sched, _ = plain_and_scheduled(workdir, "semantics_join.py", ["--how", "method", "--throw"])
    for r in (0, 1):
        assert plain[r]["raised"] and sched[r]["raised"], f"rank {r} did not raise Join's error"
        assert len(sched[r]["losses"]) == 3


@pytest.mark.slow
def test_join_dividing_by_the_ranks_not_joined_is_plain_ddp(workdir):
    """join(divide_by_initial_world_size=False) divides by the ranks not joined, which bsrun's
    rounds do not: called before the first backward, the model becomes the real DDP, said
    once (mode fallback), and the results are DDP's."""
    plain, _ = run(workdir, "plain", PLAIN, "semantics_join.py", ["--divide-by-active"])
    sched, summary = run(workdir, "sched", SCHED, "semantics_join.py", ["--divide-by-active"])
    assert {r.get("mode") for r in summary["ranks"]} == {"fallback"}, summary["ranks"]
    assert any("divide_by_initial_world_size=False" in n for n in summary["ranks"][0]["notes"])
    for r in (0, 1):
        assert_same_state(sched[r], plain[r], f"rank {r}")


@pytest.mark.slow
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_optimizer_closure_keeps_the_overlap(workdir, opt):
    """step(closure) of an elementwise optimizer (Lightning's automatic optimisation): the
    same model and losses as plain DDP, and no note of synchronising fully."""
    plain, sched, summary = plain_and_scheduled(workdir, "semantics_closure.py", ["--opt", opt])
    notes = [n for r in summary["ranks"] for n in r.get("notes", [])]
    assert not [n for n in notes if SYNCHRONISING in n], f"a closure made bsrun synchronise fully: {notes}"
    assert len(sched[0]["losses"]) == 8
    assert plain[0]["pending"] == [0] * 8
    assert any(sched[0]["pending"]), \
        f"every step(closure) settled every update: no overlap with the next forward ({sched[0]['pending']})"


@pytest.mark.slow
def test_lbfgs_closure_still_synchronises_fully(workdir):
    """LBFGS calls its closure several times and reads every gradient between the calls: it
    keeps synchronising fully, said once, and stays exact."""
    _, sched, summary = plain_and_scheduled(workdir, "semantics_closure.py", ["--opt", "lbfgs"])
    assert sched[0]["pending"] == [0] * 8, "a fully synchronised step leaves nothing pending"
    notes = [n for r in summary["ranks"] for n in r.get("notes", [])]
    assert any(SYNCHRONISING in n and "LBFGS" in n for n in notes), notes
