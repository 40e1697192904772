"""Which path a script takes: scheduled, plain DDP as a fallback, or untouched."""

import json

from conftest import WORKERS, last_run, run_bsrun

SCRIPT = WORKERS / "ddp_kind.py"


def run(workdir, *args, bsrun_args=()):
    out = workdir / "kind.json"
    proc = run_bsrun([*bsrun_args, "-np", 2, "python", SCRIPT, out, *args], cwd=workdir, check=True)
    return json.loads(out.read_text()), last_run(workdir), proc


def test_scheduled_model_is_still_a_ddp(workdir):
    kind, summary, _ = run(workdir)
    assert kind["is_ddp"] and kind["class"] == "bsrun.inject.ddp.ScheduledDDP"
    assert {r["mode"] for r in summary["ranks"]} == {"scheduled"}


def test_no_schedule_leaves_ddp_exactly_as_it_is(workdir):
    kind, summary, _ = run(workdir, bsrun_args=["--no-schedule"])
    assert kind["class"] == "torch.nn.parallel.distributed.DistributedDataParallel"
    assert {r["mode"] for r in summary["ranks"]} == {"off"}
    assert all(r["steps"] == 0 and r["partitions"] == 0 for r in summary["ranks"])


def test_find_unused_parameters_is_scheduled(workdir):
    kind, summary, _ = run(workdir, "--find-unused")
    assert kind["class"] == "bsrun.inject.ddp.ScheduledDDP"
    assert {r["mode"] for r in summary["ranks"]} == {"scheduled"}


def test_skip_all_reduce_unused_params_falls_back_to_plain_ddp_and_says_why(workdir):
    kind, summary, proc = run(workdir, "--skip-unused")
    assert kind["class"] == "torch.nn.parallel.distributed.DistributedDataParallel"
    assert {r["mode"] for r in summary["ranks"]} == {"fallback"}
    assert "skip_all_reduce_unused_params" in proc.stderr
    assert any("skip_all_reduce_unused_params" in n for n in summary["ranks"][0]["notes"])


def test_a_script_without_ddp_is_left_alone(workdir):
    kind, summary, _ = run(workdir, "--no-ddp")
    assert not kind["is_ddp"]
    assert {r["mode"] for r in summary["ranks"]} == {"off"}
    assert summary["ranks"][0]["steps"] == 3, "optimizer steps are still counted"
