"""DDP comm hooks run on bsrun's partitions, and DDP's surface that Lightning and accelerate
touch: each case against plain DDP (`--no-schedule`) on the saved parameters, and the
model really scheduled (mode scheduled, partitions > 0)."""

import pytest
import torch

from conftest import (WORKERS, adapt_of, assert_same_state, assert_same_switches, assert_scheduled, last_run,
                      run_bsrun, show)

HOOKS = WORKERS / "hooks_train.py"
# small partitions: fused ones, a matrix cut into row blocks, several partitions a round
PARTITION = ["--partition", "4KB"]


def train(workdir, case, flags, script=HOOKS, timeout=180):
    """`bsrun FLAGS -np 2 python SCRIPT [CASE] OUT`: rank 0's saved state, the run summary, stderr."""
    out = workdir / f"{case}-{'plain' if '--no-schedule' in flags else 'bsrun'}.pt"
    args = [case, out] if script == HOOKS else [out]
    proc = run_bsrun([*flags, "-np", 2, "python", script, *args], cwd=workdir, check=True, timeout=timeout)
    return torch.load(out), last_run(workdir), proc.stderr


def max_diff(a, b) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if isinstance(a[k], torch.Tensor))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["allreduce", "allreduce-group", "fp16", "accelerate-fp16", "fp16-wrapper",
                                  "builtin-fp16", "powersgd-full"])
def test_hook_runs_scheduled_and_equals_plain_ddp_with_it(workdir, case):
    """allreduce is DDP's own averaging; fp16 compression is elementwise, so no layout changes
    it; PowerSGD at full rank is exact up to rounding and runs its whole machinery (error
    feedback, per-bucket memories by index(), iterations counted by is_last()). Adaptation
    (on by default) switches points mid-run under every hook but PowerSGD, whose state is
    per bucket: the parameters stay equal through the switches."""
    plain, _, _ = train(workdir, case, ["--no-schedule"])
    sched, run, stderr = train(workdir, case, PARTITION)
    assert_scheduled(run, context=stderr)
    assert "not scheduling" not in stderr
    assert_same_state(sched, plain, atol=1e-6 if case == "powersgd-full" else 1e-8)
    if case.startswith("powersgd"):
        adapts = [adapt_of(run, r) for r in (0, 1)]
        assert all(a["state"] == "off" and "PowerSGD" in a["why_off"] for a in adapts), adapts
        return
    switches = assert_same_switches(run)
    assert len({str(s["point"]) for s in switches}) >= 2, f"adaptation never left its first point:\n{show(switches)}"


@pytest.mark.slow
def test_fp16_hook_really_compresses(workdir):
    exact, _, _ = train(workdir, "allreduce", PARTITION)
    fp16, _, _ = train(workdir, "fp16", PARTITION)
    assert max_diff(fp16, exact) > 1e-7


@pytest.mark.slow
def test_powersgd_differs_from_plain_ddp_by_no_more_than_its_own_noise(workdir):
    """Low-rank PowerSGD depends on how gradients are bucketed (its random start is drawn per
    bucket). Plain DDP with PowerSGD at another bucket_cap_mb hangs on gloo (its callbacks
    issue collectives from two threads), so the measure of its noise is plain DDP with
    another random seed."""
    plain, _, _ = train(workdir, "powersgd", ["--no-schedule"])
    reseeded, _, _ = train(workdir, "powersgd-seed", ["--no-schedule"])
    exact, _, _ = train(workdir, "allreduce", ["--no-schedule"])
    sched, run, stderr = train(workdir, "powersgd", PARTITION)
    assert_scheduled(run, context=stderr)
    assert "not scheduling" not in stderr
    noise = max_diff(reseeded, plain)
    assert max_diff(plain, exact) > 1e-4  # compression ran
    assert max_diff(sched, plain) <= 2 * noise, (max_diff(sched, plain), noise)
    assert sched["iter"] == plain["iter"] == 10  # is_last() once a round
    assert torch.equal(sched["random"], plain["random"])  # the script's random stream untouched


@pytest.mark.slow
@pytest.mark.parametrize("case, line", [
    ("other-group", "not scheduling this model (the DDP comm hook allreduce_hook on a process group other "
                    "than the model's); it runs as plain DDP"),
    ("unknown", "not scheduling this model (a DDP comm hook bsrun does not know: my_hook); it runs as plain DDP"),
])
def test_hook_bsrun_cannot_run_keeps_the_real_ddp(workdir, case, line):
    plain, _, _ = train(workdir, case, ["--no-schedule"])
    sched, run, stderr = train(workdir, case, PARTITION)
    assert {r["mode"] for r in run["ranks"]} == {"fallback"}, stderr
    assert stderr.count(line) == 1, stderr
    assert_same_state(sched, plain)


@pytest.mark.slow
def test_ddp_surface_as_lightning_and_accelerate_touch_it(workdir):
    pytest.importorskip("lightning")
    plain, _, _ = train(workdir, "surface", ["--no-schedule"], script=WORKERS / "hooks_surface.py", timeout=300)
    sched, run, stderr = train(workdir, "surface", [], script=WORKERS / "hooks_surface.py", timeout=300)
    assert_scheduled(run, context=stderr)
    assert "not scheduling" not in stderr
    surface = sched.pop("surface")
    plain_surface = plain.pop("surface")
    assert_same_state(sched, plain)  # the sync re-armed by reducer.prepare_for_backward happened
    for when in ("before", "after"):
        assert surface[when] == {**plain_surface[when], "logged_static_graph": None}
    assert surface["before"]["gradient_as_bucket_view"] is True and surface["before"]["static_graph"] is False
    assert surface["static"] and surface["static_logged"] == 1
    assert surface["other_static"] and surface["warned_twice"]


def test_bucket_views_follow_each_piece_of_the_partition():
    """gradients() are views of the buffer: whole tensors in their shape, a cut between rows
    as those rows, any other cut flat; index() and is_last() as the backend gives them."""
    from bsrun.inject.comm_hooks import ScheduledHook
    from bsrun.sched.partition import TensorInfo, plan_partitions
    params = [torch.nn.Parameter(torch.zeros(6, 4)), torch.nn.Parameter(torch.zeros(3)),
              torch.nn.Parameter(torch.zeros(5, 3))]
    infos = [TensorInfo(p.numel(), 4, "torch.float32") for p in params]
    parts = plan_partitions(infos, [0, 1, 2], 48)  # 12 floats: (6,4) in two row blocks, (3,), (5,3) cut as 8 + 7
    hook = ScheduledHook(lambda s, b: None, None, params)
    shapes = []
    for part in parts:
        data = torch.arange(sum(pc.stop - pc.start for pc in part.pieces), dtype=torch.float32)
        bucket = hook._bucket(part, data, last=part.pid == len(parts) - 1)
        assert bucket.index() == part.pid and bucket.buffer() is data
        assert bucket.is_last() == (part.pid == len(parts) - 1)
        for grad in bucket.gradients():
            assert grad.data_ptr() >= data.data_ptr()  # a view, not a copy
            grad.add_(100)
        assert (data >= 100).all()
        shapes.append([tuple(g.shape) for g in bucket.gradients()])
        assert bucket.parameters() == [params[pc.tensor] for pc in part.pieces]
    assert shapes == [[(3, 4)], [(3, 4)], [(3,)], [(8,)], [(7,)]]
