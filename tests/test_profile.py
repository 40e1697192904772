"""bsrun profile records what the issue promises, on real 2-rank gloo launches.

One scheduled and one unscheduled profile of tests/workers/profile_target.py are shared
by the tests that read them (module fixtures); Ctrl-C gets a launch of its own.
"""

import json
import signal
import statistics
import subprocess
import sys
from collections import Counter, defaultdict

import pytest
import torch

from conftest import WORKERS, assert_same_state, bsrun_env, last_run, run_bsrun, signal_when, start_bsrun

TARGET = WORKERS / "profile_target.py"
MODULES = ["Net", "features", "features.0", "features.1", "features.2", "features.3", "features.4", "features.5",
           "features.6", "head", "head.0", "head.1", "head.2"]
LAYERS = ["features.0", "features.1", "features.4", "head.0", "head.2"]
WARMUP, STEPS = 1, 3


def profile(folder, *flags, steps=STEPS, script_steps=20, extra=()):
    until = ["--steps", steps] if steps else []  # else: record until the script ends
    proc = run_bsrun(["profile", "-o", folder, "--warmup", WARMUP, *until, *flags, "-np", 2,
                      sys.executable, TARGET, "--steps", script_steps, *extra], cwd=folder.parent, check=True)
    return proc, json.loads((folder / "trace.json").read_text())


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scheduled") / "prof"
    proc, trace = profile(folder, "--partition", "64KiB")
    return folder, proc, trace


@pytest.fixture(scope="module")
def unscheduled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("unscheduled") / "prof"
    proc, trace = profile(folder, "--no-schedule", steps=None, script_steps=5,
                          extra=["--out", folder.parent / "profiled.pt"])
    return folder, proc, trace


def spans(trace, pid, cat):
    return [e for e in trace["traceEvents"] if e.get("pid") == pid and e.get("cat") == cat and e["ph"] == "X"]


def steps_of(trace, pid):
    return sorted(e["ts"] for e in trace["traceEvents"] if e.get("pid") == pid and e.get("cat") == "step")


def backward_ends(trace, pid):
    """{n: when rank pid's last backward pass of iteration n ended}; iteration n runs from
    the step() return before it to step n's."""
    bounds = sorted((e["ts"], e["args"]["step"]) for e in trace["traceEvents"]
                    if e.get("pid") == pid and e.get("cat") == "step")
    ends = [e["ts"] + e["dur"] for e in spans(trace, pid, "pass") if e["name"].startswith("backward")]
    return {n: max(t for t in ends if a < t <= b) for (a, _), (b, n) in zip(bounds, bounds[1:])}


def assert_nested(trace):
    """On every thread of every rank, complete events nest: none ends inside another."""
    by_thread = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_thread[(e["pid"], e["tid"])].append(e)
    for key, events in by_thread.items():
        stack = []
        for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - 0.01:
                stack.pop()
            if stack:
                top = stack[-1]
                assert e["ts"] + e["dur"] <= top["ts"] + top["dur"] + 0.01, \
                    f"rank {key[0]} thread {key[1]}: {e['name']} overlaps the end of {top['name']}"
            stack.append(e)


def test_a_scheduled_profile_has_both_ranks_every_module_and_every_partition(scheduled):
    folder, proc, trace = scheduled
    assert trace["distributedInfo"]["world_size"] == 2
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"compute", "communication", "updates"} <= threads
    sizes = trace["bsrun"]["ranks"]["0"]["partition_layout"]["0"]["sizes"]
    assert len(sizes) >= 5, sizes  # 556 KB of gradients in 64 KiB partitions
    for rank in (0, 1):
        boundaries = steps_of(trace, rank)
        assert len(boundaries) == STEPS + 1, boundaries  # recording: after step 1 to step 4
        lo, hi = boundaries[0], boundaries[-1]
        forward = Counter(e["args"]["module"] for e in spans(trace, rank, "forward") if lo <= e["ts"] < hi)
        assert forward == {m: STEPS for m in MODULES}, forward
        backward = Counter(e["args"]["module"] for e in spans(trace, rank, "backward") if lo <= e["ts"] < hi)
        assert backward == {m: STEPS for m in LAYERS}, backward
        rounds = defaultdict(set)
        for t in spans(trace, rank, "transfer"):
            rounds[t["args"]["round"]].add(t["args"]["partition"])
            assert t["args"]["ready_us"] <= t["args"]["post_us"] <= t["args"]["finish_us"]
        for r in range(WARMUP + 1, WARMUP + STEPS + 1):  # every partition of every recorded round
            assert rounds[r] == set(range(len(sizes))), (rank, r, rounds[r])
        grads = Counter(e["args"]["param"] for e in trace["traceEvents"]
                        if e.get("pid") == rank and e.get("cat") == "grad" and lo <= e["ts"] < hi)
        assert len(grads) == 10 and set(grads.values()) == {STEPS}
        assert spans(trace, rank, "update")
    assert_nested(trace)
    offset = trace["bsrun"]["ranks"]["1"]["clock_offset_us"]
    assert abs(offset) < 5000, f"one machine, one clock: offset {offset} us"
    assert [r["steps"] for r in last_run(folder.parent)["ranks"]] == [WARMUP + STEPS] * 2  # the job ended there


def test_the_summary_tables_and_timeline_tell_the_same_story(scheduled):
    folder, proc, trace = scheduled
    summary = json.loads((folder / "summary.json").read_text())
    assert [r["name"] for r in summary["layers"]] == LAYERS
    assert len(summary["iterations"]) == STEPS and summary["scheduled"]
    for row in summary["iterations"]:
        assert 0 < row["compute_ms"] <= row["step_ms"] * 1.001
        assert 0 < row["comm_ms"] and 0 <= row["overlap_pct"] <= 100
        ranks = list(row["per_rank"].values())  # a row averages the ranks: the bound is each rank's
        assert all(r["bound_ms"] == pytest.approx(max(r["compute_ms"], r["comm_ms"])) for r in ranks)
        assert row["bound_ms"] == pytest.approx(sum(r["bound_ms"] for r in ranks) / len(ranks))
        assert row["slowest_compute_ms"] == max(r["compute_ms"] for r in ranks) >= row["compute_ms"]
    assert summary["median"]["slowest_compute_ms"] == pytest.approx(
        statistics.median(r["slowest_compute_ms"] for r in summary["iterations"]))
    assert "slowest rank's compute" in proc.stdout  # what no schedule can take off the step
    ends = [backward_ends(trace, rank) for rank in (0, 1)]  # the rank lag, from the raw events
    for row in summary["iterations"]:
        n = row["step"]
        assert row["rank_lag_ms"] == pytest.approx(abs(ends[0][n] - ends[1][n]) / 1e3, abs=1e-3), n
    assert summary["median"]["rank_lag_ms"] == pytest.approx(
        statistics.median(r["rank_lag_ms"] for r in summary["iterations"]))
    assert "rank lag: the ranks' backward passes end" in proc.stdout
    for row in summary["layers"]:
        assert row["forward_ms"] > 0 and row["backward_ms"] > 0 and row["comm_ms"] > 0
    assert summary["layers"][3]["bytes"] == (512 * 256 + 256) * 4  # head.0: Linear(512, 256)
    assert (folder / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for layer in LAYERS:
        assert layer in proc.stdout
    assert "per iteration" in proc.stdout and "efficiency" in proc.stdout
    shown = run_bsrun(["profile", "show", folder, "--json"], cwd=folder.parent, check=True)
    again = json.loads(shown.stdout)
    assert again["iterations"] == summary["iterations"] and again["layers"] == summary["layers"]


def test_whatif_predicts_other_configs_from_the_profile(scheduled):
    folder, _, trace = scheduled
    from bsrun.profile import whatif

    model = whatif.fit(trace)
    assert model.alpha >= 0 and model.beta > 0
    small = whatif.predict_detail(model, 64 * 1024, 128 * 1024, True)
    assert small["collectives"] == len(trace["bsrun"]["ranks"]["0"]["partition_layout"]["0"]["sizes"])
    proc = run_bsrun(["profile", "whatif", folder, "--partition", "1MB", "--credit", "4x", "--json"],
                     cwd=folder.parent, check=True)
    result = json.loads(proc.stdout)
    assert result["config"] == {"scheduled": True, "partition": 10 ** 6, "credit": 4 * 10 ** 6}
    _, sizes, _ = whatif.layout(model, 10 ** 6, True)  # 556 KB: the ramp's 256 KiB caps, then the rest
    assert result["replay"]["collectives"] == len(sizes) < small["collectives"]
    assert result["predicted_step_s"] == pytest.approx(whatif.predict(model, 10 ** 6, 4 * 10 ** 6, True))
    unscheduled = run_bsrun(["profile", "whatif", folder, "--no-schedule"], cwd=folder.parent, check=True)
    assert "unscheduled (DDP buckets)" in unscheduled.stdout


def test_the_perfect_schedule_lies_between_the_bound_and_the_profiled_schedule(scheduled):
    """whatif.best_schedule (the bench's `replay` mode, a line of `bsrun profile`): the same
    compute, link and dependencies, no cost per collective or decision. No schedule on one
    link beats either part alone, and this one is not slower than the replay of what ran."""
    folder, proc, trace = scheduled
    from bsrun.profile import whatif

    model = whatif.fit(trace)
    best = whatif.best_schedule(model)
    summary = json.loads((folder / "summary.json").read_text())  # and `bsrun profile` says it
    assert summary["whatif"]["perfect_schedule_ms"] == pytest.approx(best["step_s"] * 1e3)
    assert "a perfect schedule of this job" in proc.stdout
    profiled = whatif.predict(model, model.profiled["partition"], model.profiled["credit"], True)
    compute = max(r.before_forward + r.forward + r.before_backward + r.backward + r.after_backward
                  for r in whatif.compute_for(model, scheduled=False))
    link = model.beta * sum(p["bytes"] for p in model.params)
    assert max(compute, link) * 0.999 <= best["step_s"] <= profiled * 1.001, (compute, link, best, profiled)
    assert best["collectives"] >= sum(p["bytes"] for p in model.params) / whatif.PERFECT_PARTITION
    steps = whatif.gap_breakdown(model)  # the costs added back one at a time
    assert len(steps) == 4 and steps[0][1] == best["step_s"] and steps[-1][1] == pytest.approx(profiled)


def test_an_unscheduled_profile_times_ddp_buckets_without_changing_ddp(unscheduled, tmp_path):
    folder, _, trace = unscheduled
    meta = trace["bsrun"]["ranks"]["0"]
    assert meta["comm"] == ["ddp-hook"] and "bsrun not scheduling" in meta["communication"][0]
    for rank in (0, 1):
        boundaries = steps_of(trace, rank)
        assert len(boundaries) == 5
        transfers = [t for t in spans(trace, rank, "transfer") if boundaries[0] <= t["args"]["post_us"]]
        assert transfers and all(t["name"].startswith("bucket ") for t in transfers)
        per_step = Counter(t["args"]["step"] for t in transfers)
        assert len(per_step) == 4 and len(set(per_step.values())) == 1, per_step
        assert sum(t["args"]["bytes"] for t in transfers) == 4 * sum(p["bytes"] for p in meta["params"])
        assert len(spans(trace, rank, "update")) == 4  # one optimizer.step per iteration
    assert_nested(trace)
    # The same script unprofiled: the timing comm hook computes exactly what DDP does.
    plain = tmp_path / "plain.pt"
    run_bsrun(["--no-schedule", "-np", 2, sys.executable, TARGET, "--steps", 5, "--out", plain], cwd=tmp_path,
              check=True)
    assert_same_state(torch.load(folder.parent / "profiled.pt"), torch.load(plain))


def test_ctrl_c_still_leaves_a_valid_merged_trace(tmp_path):
    folder = tmp_path / "prof"
    proc = start_bsrun(["profile", "-o", folder, "--warmup", 0, "-np", 2, sys.executable, TARGET,
                        "--steps", 100000, "--sleep", 0.05], tmp_path)

    def recorded_steps():
        try:
            return all((folder / f"rank-{r}.jsonl").read_text().count('["S",') >= 4 for r in (0, 1))
        except OSError:
            return False

    code, err = signal_when(proc, recorded_steps, signal.SIGINT, "four recorded steps on both ranks", timeout=60)
    assert code == 130, err
    trace = json.loads((folder / "trace.json").read_text())  # valid JSON, merged after the stop
    for rank in (0, 1):
        assert len(steps_of(trace, rank)) >= 4
        assert spans(trace, rank, "forward") and spans(trace, rank, "transfer")
    assert_nested(trace)
    assert json.loads((folder / "summary.json").read_text())["iterations"]


def test_a_rank_file_cut_short_by_a_kill_still_merges(scheduled, tmp_path):
    folder, _, _ = scheduled
    from bsrun.profile import trace as trace_module

    for r in (0, 1):
        text = (folder / f"rank-{r}.jsonl").read_text()
        (tmp_path / f"rank-{r}.jsonl").write_text(text[: len(text) - len(text.splitlines()[-2]) // 2 - 40])
    merged = trace_module.load(tmp_path)  # no trace.json there: merged from the rank files
    assert (tmp_path / "trace.json").exists()
    assert merged["bsrun"]["ranks"]["0"]["unreadable_lines"] == 1
    assert not merged["bsrun"]["ranks"]["0"]["complete"]
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}


def test_the_analysis_side_never_imports_torch(scheduled):
    folder, _, _ = scheduled
    code = ("import sys; from bsrun.cli import main\n"
            "try:\n    main(['profile', 'show', sys.argv[1], '--json'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if any(m == 'torch' or m.startswith('torch.') for m in sys.modules) else 'CLEAN')")
    out = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, env=bsrun_env(),
                         timeout=120).stdout
    assert out.strip().endswith("CLEAN")


def test_replay_rules():
    """The replay's own rules: DDP's buckets as torch DDP itself assigns them, and the
    credit keeping one partition in flight at a time, most urgent first."""
    import torch.distributed as dist

    from bsrun.bench.models import build
    from bsrun.profile import whatif
    from bsrun.sched.partition import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, ddp_buckets

    for name in ("vgg16", "resnet50"):
        ready_order = list(reversed(list(build(name).parameters())))  # DDP's initial bucket order
        torchs, _ = dist._compute_bucket_assignment_by_size(ready_order, [DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES])
        ours = ddp_buckets([p.numel() * p.element_size() for p in ready_order])
        assert sorted(map(sorted, ours)) == sorted(map(sorted, torchs)), name
    finish = whatif._issue_round({0: 1.0, 1: 1.0, 2: 0.0}, [100, 100, 100], [100, 100, 100], credit=100, alpha=0.5,
                                 beta=0.01, decision=0.0, link_free=0.0)
    assert finish == {2: pytest.approx(1.5), 0: pytest.approx(3.0), 1: pytest.approx(4.5)}
    # p1 a table that sends 20 B: charged at its dense 300 B it waits for an empty credit and
    # goes last; charged as one partition (40 B, task.credit_charges) it queues behind p2
    sizes, ready = [100, 20, 100], {0: 1.0, 1: 0.1, 2: 0.0}
    for charges, expected in (([100, 300, 100], {2: 1.5, 0: 3.0, 1: 3.7}), ([100, 40, 100], {2: 1.5, 1: 2.2, 0: 3.7})):
        finish = whatif._issue_round(ready, sizes, charges, credit=150, alpha=0.5, beta=0.01, decision=0.0,
                                     link_free=0.0)
        assert finish == pytest.approx(expected) and sorted(finish, key=finish.get) == list(expected), charges


def test_a_horovod_script_is_profiled_too(tmp_path):
    pytest.importorskip("horovod.torch", reason="needs Horovod (scripts/install-horovod.sh)")
    folder = tmp_path / "prof"
    run_bsrun(["profile", "-o", folder, "--warmup", 1, "--steps", 2, "-np", 2, sys.executable,
               WORKERS.parent.parent / "examples" / "train_hvd.py"], cwd=tmp_path, check=True, timeout=180)
    trace = json.loads((folder / "trace.json").read_text())
    for rank in (0, 1):
        layers = {e["args"]["module"] for e in spans(trace, rank, "backward")}
        assert layers == {"conv1", "bn1", "conv2", "bn2", "fc1", "fc2"}
        assert spans(trace, rank, "transfer")  # bsrun schedules hvd.DistributedOptimizer
    assert "Horovod" in trace["bsrun"]["ranks"]["1"]["clock_method"]
    assert_nested(trace)
