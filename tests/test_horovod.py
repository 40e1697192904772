"""Horovod scripts: bsrun launches them itself, wraps horovodrun, and schedules
`hvd.DistributedOptimizer` with the same results as plain `horovodrun`.

The reference run of each case is the script under plain `horovodrun --gloo` (no bsrun
anywhere); bsrun's runs are compared with it by allclose(rtol=1e-5).
"""

import os
import shutil
import sys

import pytest
import torch

from conftest import (REPO, WORKERS, assert_same_state, assert_same_switches, bsrun_env, bsrun_namespaces, last_run,
                      run_as_group, run_bsrun, show)

pytest.importorskip("horovod.torch", reason="Horovod is not installed (scripts/install-horovod.sh)")
SCRIPT = WORKERS / "train_hvd.py"
HOROVODRUN = shutil.which("horovodrun") or os.path.join(os.path.dirname(sys.executable), "horovodrun")


_PLAIN_RUNS: dict[tuple, object] = {}  # script arguments -> the saved state of its plain horovodrun


def plain_horovodrun(workdir, args):
    """Rank 0's saved state under plain `horovodrun --gloo -np 2`. The script is seeded and
    the sums of 2 ranks are deterministic, so each arguments' reference is run once per
    session and shared by the cases that compare with it."""
    key = tuple(map(str, args))
    if key in _PLAIN_RUNS:
        return torch.load(_PLAIN_RUNS[key])
    out = workdir / "plain.pt"
    proc = run_as_group([HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, SCRIPT, *args,
                         "--out", out], 120, cwd=workdir, env=bsrun_env())
    assert proc.returncode == 0, f"plain horovodrun failed:\n{proc.stdout}\n{proc.stderr}"
    _PLAIN_RUNS[key] = out
    return torch.load(out)


def bsrun_hvd(workdir, args, bsrun_args=("-np", 2, "python")):
    out = workdir / "sched.pt"
    proc = run_bsrun([*bsrun_args, SCRIPT, *args, "--out", out], cwd=workdir, check=True)
    return torch.load(out), last_run(workdir), proc


CASES = {
    "sgd-1KiB": (["--optimizer", "sgd"], "1KiB"),
    "adam-1KiB": (["--optimizer", "adam"], "1KiB"),
    "sgd-64MB": (["--optimizer", "sgd"], "64MB"),
    "adam-64MB": (["--optimizer", "adam"], "64MB"),
    "backward-passes-per-step": (["--optimizer", "sgd", "--passes", "3", "--steps", "6"], "4KiB"),
    "synchronize-clip-skip": (["--optimizer", "sgd", "--clip", "0.5"], "4KiB"),
    "predivide-factor": (["--optimizer", "adam", "--predivide", "2"], "4KiB"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_scheduled_horovod_equals_plain_horovodrun(workdir, case):
    args, partition = CASES[case]
    plain = plain_horovodrun(workdir, args)
    sched, run, _ = bsrun_hvd(workdir, args, ["--partition", partition, "--credit", "2x", "-np", 2, "python"])
    assert {r["mode"] for r in run["ranks"]} == {"scheduled"}
    r0 = run["ranks"][0]
    assert r0["partitions"] > 0 and r0["bytes"] > 0
    if partition == "1KiB":
        assert r0["partitions"] > 10 * r0["rounds"], "tiny partitions must cut tensors into many pieces"
    if partition == "64MB":
        assert r0["partitions"] == r0["rounds"], "a huge partition fuses the whole model into one"
    assert_same_state(sched, plain)
    # adaptation (on by default) switched points mid-run, at the same steps on both ranks,
    # and the parameters above stayed Horovod's through the switches
    switches = assert_same_switches(run)
    if "--steps" not in args:  # 12 optimizer steps: the start (step 2) and one more point (step 6)
        assert len({str(s["point"]) for s in switches}) >= 2, f"adaptation never switched:\n{show(switches)}"


@pytest.mark.slow
def test_bsrun_wraps_horovodrun(workdir):
    args = ["--optimizer", "adam"]
    plain = plain_horovodrun(workdir, args)
    sched, run, _ = bsrun_hvd(workdir, args, ["--partition", "8KiB", HOROVODRUN, "--gloo", "-np", 2,
                                              "-H", "localhost:2", sys.executable])
    assert run["kind"] == "wrap"
    assert sorted(r["rank"] for r in run["ranks"]) == [0, 1]
    assert {r["mode"] for r in run["ranks"]} == {"scheduled"}
    assert run["ranks"][0]["partitions"] > run["ranks"][0]["rounds"]
    assert_same_state(sched, plain)


@pytest.mark.slow
def test_unschedulable_optimizer_falls_back_to_horovod_with_one_line(workdir):
    args = ["--optimizer", "sgd", "--fp16"]
    plain = plain_horovodrun(workdir, args)
    sched, run, proc = bsrun_hvd(workdir, args)
    assert {r["mode"] for r in run["ranks"]} == {"fallback"}
    assert proc.stderr.count("not scheduling this optimizer (gradient compression)") == 1
    assert_same_state(sched, plain)


@pytest.mark.slow
def test_no_schedule_leaves_horovod_untouched(workdir):
    args = ["--optimizer", "sgd"]
    plain = plain_horovodrun(workdir, args)
    sched, run, _ = bsrun_hvd(workdir, args, ["--no-schedule", "-np", 2, "python"])
    assert {r["mode"] for r in run["ranks"]} == {"off"}
    assert_same_state(sched, plain)


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root (network namespaces, tc)")
def test_horovod_across_emulated_hosts(workdir):
    """Each rank in its own namespace: Horovod's rendezvous and gloo over the emulated links."""
    args = ["--optimizer", "adam"]
    plain = plain_horovodrun(workdir, args)
    sched, run, proc = bsrun_hvd(workdir, args, ["--emulate-bandwidth", "1gbit", "--partition", "16KiB",
                                                 "-np", 2, "python"])
    assert "emulated network: 2 hosts" in proc.stderr
    assert {r["mode"] for r in run["ranks"]} == {"scheduled"}
    assert_same_state(sched, plain)
    assert bsrun_namespaces() == []


@pytest.mark.slow
def test_the_horovod_example_runs_scheduled(workdir):
    proc = run_bsrun(["-np", 2, "python", REPO / "examples" / "train_hvd.py", "--steps", 10], cwd=workdir,
                     check=True)
    assert "step 10: loss" in proc.stdout
    assert {r["mode"] for r in last_run(workdir)["ranks"]} == {"scheduled"}
