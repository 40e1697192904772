"""The benchmark measures every mode with real launches and reports what DESIGN.md asks.

Each launching test runs the `tiny` model with 2 real gloo ranks; no mocks. Timings are
only asserted where they hold by construction (the bound is the larger of its parts), never
as a race between two runs.
"""

import io
import json
import os
import signal
import sys

import psutil
import pytest
from rich.console import Console

from bsrun.bench.launches import ADAPTING_MODES, MODES, RunResult, _first_keep, _late_decisions, compared_warmup, launch_args, run_once
from bsrun.bench.runner import bench_table, run_bench, summarise
from bsrun.console import new_console
from bsrun.errors import BsrunError
from bsrun.sched.adaptive import SEARCH_STEPS
from conftest import signal_when, start_bsrun

REQUIRED = {"model", "bandwidth", "mode", "median_step_s", "mean_step_s", "warmup", "spread", "speedup_vs_ddp",
            "efficiency", "attainable_gain", "captured", "compute_part_s", "comm_part_s", "repeats", "steps"}


def bench(tmp_path, bandwidths, modes, **arch):
    out = io.StringIO()
    path = tmp_path / "bench.json"
    records = run_bench(["tiny"], 2, bandwidths, modes, steps=3, warmup=1, repeat=1, batch=None,
                        json_path=str(path), console=Console(file=out, width=160), **arch)
    return records, json.loads(path.read_text()), out.getvalue()


def check(records, saved, text, bandwidth, modes):
    assert [r["mode"] for r in records] == list(modes), text
    for r in records:
        assert r["failed_repeats"] == 0, f"{r['mode']} failed: {r['errors']}\n{text}"
        assert r["median_step_s"] > 0 and r["repeats"] == 1 and r["steps"] == 3
        assert r["bandwidth"] == bandwidth and r["model"] == "tiny"
        assert r["spread"][0] <= r["median_step_s"] <= r["spread"][1]
        assert r["mean_step_s"] > 0
        # rank 0's cost a timed step: CPU of all its threads and context switches (a replay runs no worker)
        (cpu,), (switches,) = r["cpu_s_per_step"], r["context_switches_per_step"]
        assert (cpu, switches) == (None, None) if r["mode"] == "replay" else cpu > 0 and switches >= 0, r
    # every mode's timed steps start at the same step: after the first search when one adapts
    adapting = any(m in ADAPTING_MODES for m in modes)
    assert {r["warmup"] for r in records} == {1 + SEARCH_STEPS if adapting else 1}, text
    assert saved["results"] == records
    assert all(REQUIRED <= rec.keys() for rec in saved["results"])
    by_mode = {r["mode"]: r for r in records}
    assert by_mode["ddp"]["speedup_vs_ddp"] == pytest.approx(1.0)
    assert "tiny" in text and "ddp" in text


@pytest.mark.slow
def test_every_mode_on_loopback(tmp_path):
    pytest.importorskip("horovod.torch", reason="the horovod modes need Horovod (scripts/install-horovod.sh)")
    modes = [*MODES, "bsrun-fixed", "bsrun-horovod-fixed"]
    records, saved, text = bench(tmp_path, [None], modes)
    check(records, saved, text, None, modes)
    by_mode = {r["mode"]: r for r in records}
    bound = by_mode["bound"]
    assert bound["efficiency"] == pytest.approx(1.0)
    # by construction (each step's bound is max(compute, comm)), not a race between runs
    assert bound["median_step_s"] >= bound["compute_part_s"] > 0
    assert bound["median_step_s"] >= bound["comm_part_s"] > 0
    assert all(r["compute_part_s"] is None for r in records if r["mode"] != "bound")
    gain = bound["attainable_gain"]  # one per group; its sign is the machine's noise at 3 steps
    assert all(r["attainable_gain"] == gain for r in records)
    if gain > 0:
        assert bound["captured"] == pytest.approx(1.0) and by_mode["ddp"]["captured"] == pytest.approx(0.0)
    else:
        assert all(r["captured"] is None for r in records)
    assert by_mode["horovod"]["speedup_vs_horovod"] == pytest.approx(1.0)
    for scheduled in ("bsrun", "bsrun-fixed", "bsrun-horovod", "bsrun-horovod-fixed"):
        assert by_mode[scheduled]["launched_as"] == ["scheduled"]
    for plain in ("ddp", "horovod", "bound", "overlap"):
        assert by_mode[plain]["launched_as"] == ["off"]
    # its first search ends before the timed steps (the warm-up has SEARCH_STEPS more: the whole search's
    # budget); a tiny model's steps can drift by 25% after it, so a re-check may run into them (late_decisions)
    for adapting in ("bsrun", "bsrun-horovod"):
        (first_keep,) = by_mode[adapting]["first_keep_steps"]
        assert first_keep is not None and first_keep <= 1 + SEARCH_STEPS, by_mode[adapting]
        (kept,) = by_mode[adapting]["kept_points"]
        assert "(settled: keep: " in kept or by_mode[adapting]["late_decisions"] != [[]], by_mode[adapting]
    assert by_mode["bsrun-horovod-fixed"]["kept_points"] == []  # --no-adapt
    assert "vs horovod" in text and "attainable" in text and "captured" in text


@pytest.mark.slow
def test_the_bound_of_each_step_is_the_larger_of_its_parts(tmp_path):
    out = tmp_path / "bound.json"
    run = run_once(launch_args("tiny", "bound", 2, None, 3, 1, None, out), "bound", tmp_path, out, timeout=120)
    assert run.error is None, run.error
    compute, comm = run.info["compute_times"], run.info["comm_times"]
    assert len(run.step_times) == len(compute) == len(comm) == 3
    for step, c, m in zip(run.step_times, compute, comm):
        assert c > 0 and m > 0 and step == max(c, m)


@pytest.mark.slow
def test_parameter_servers_and_orders_side_by_side(tmp_path):
    """The orders as bench modes: tac (which profiles the job first) and fifo; every order's
    exactness is test_ordering's."""
    modes = ["ddp", "ps", "bsrun", "bsrun:tac", "bsrun:fifo"]
    records, saved, text = bench(tmp_path, [None], modes, arch="ps", servers=2)
    check(records, saved, text, None, modes)
    by_mode = {r["mode"]: r for r in records}
    assert by_mode["ps"]["speedup_vs_ps"] == pytest.approx(1.0) and "vs ps" in text
    assert all(by_mode[m]["launched_as"] == ["scheduled"] for m in modes[1:])
    assert all(r["step_iqr_s"] >= 0 for r in records) and "step IQR" in text


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces and tc")
def test_two_modes_on_an_emulated_network(tmp_path):
    records, saved, text = bench(tmp_path, ["1gbit"], ["ddp", "bsrun"])
    check(records, saved, text, "1gbit", ["ddp", "bsrun"])
    assert all(r["efficiency"] is None and r["attainable_gain"] is None and r["captured"] is None
               for r in records)  # bound was not run


def test_bad_arguments_fail_before_launching(tmp_path):
    with pytest.raises(BsrunError, match="unknown mode"):
        run_bench(["tiny"], 2, [None], ["fast"], 3, 1, 1, None, None, Console(file=io.StringIO()))
    with pytest.raises(BsrunError, match="rate such as"):
        run_bench(["tiny"], 2, ["fast"], ["ddp"], 3, 1, 1, None, None, Console(file=io.StringIO()))


def test_sigterm_stops_the_running_launch_and_removes_the_scratch_folder(tmp_path):
    """A bench ended by SIGTERM (a batch system's kill, a CI timeout) stops the launch it is
    running and removes its scratch folder, which holds every run's files and profiles."""
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    proc = start_bsrun(["bench", "--model", "tiny", "--modes", "ddp", "--steps", 100000, "--warmup", 1,
                        "--repeat", 1, "--json", tmp_path / "bench.json"], tmp_path, env={"TMPDIR": str(scratch_root)})
    workers: list[psutil.Process] = []

    def training():
        workers[:] = [p for p in psutil.Process(proc.pid).children(recursive=True)
                      if p.cmdline()[1:3] == ["-m", "bsrun.bench.worker"]]
        return len(workers) == 2 and list(scratch_root.glob("bsrun-bench-*"))

    code, err = signal_when(proc, training, signal.SIGTERM, "the bench's workers training", settle=1.0, timeout=60)
    assert code == 128 + signal.SIGTERM, err
    assert "bench stopped by SIGTERM" in err, err
    assert not list(scratch_root.glob("bsrun-bench-*")), "the scratch folder is removed"
    _, alive = psutil.wait_procs(workers, timeout=15)
    assert not alive, f"workers left running: {alive}"


def test_a_failed_run_is_reported_and_the_others_are_kept(tmp_path):
    out = tmp_path / "r.json"
    args = ["--no-schedule", "-np", "2", sys.executable, "-m", "bsrun.bench.worker", "--model", "tiny",
            "--mode", "ddp", "--steps", "0", "--out", str(out)]
    failed = run_once(args, "ddp", tmp_path, out, timeout=60)
    assert failed.error.startswith("exited with code 2"), failed.error
    assert "--steps and --batch must be at least 1" in failed.error  # the tail of its output
    ok = RunResult("ddp", [0.5, 0.9, 0.6], {"batch": 16, "params": 1, "grad_bytes": 4})
    (rec,) = summarise("tiny", None, 2, 3, [failed, ok], ["ddp"])
    assert rec["repeats"] == 1 and rec["failed_repeats"] == 1
    assert rec["median_step_s"] == pytest.approx(0.6) and rec["errors"] == ["exited with code 2"]
    assert rec["mean_step_s"] == pytest.approx(2.0 / 3)  # beside the median: a long step counts


def test_only_the_default_modes_adapt_and_every_other_scheduled_mode_is_fixed(tmp_path):
    def args(mode, arch="allreduce"):
        return launch_args("tiny", mode, 2, None, 3, 1, None, tmp_path / "r.json", arch, 1, tmp_path)

    def flags(mode, arch="allreduce"):
        a = args(mode, arch)
        return a[:a.index("-np")]

    for adapting in ("bsrun", "bsrun-horovod"):
        assert flags(adapting) == ["--schedule"], adapting
    assert flags("bsrun", "ps")[:1] == ["--schedule"] and "--no-adapt" not in flags("bsrun", "ps")
    assert "--arch" not in flags("bsrun-horovod-fixed", "ps")  # Horovod stays on its all-reduce
    for fixed in ("bsrun-fixed", "bsrun-horovod-fixed", "ps", "bsrun:forward", "bsrun:tic", "bsrun:tac", "bsrun:fifo"):
        assert flags(fixed)[:2] == ["--schedule", "--no-adapt"], fixed
    for plain in ("ddp", "horovod", "compute", "comm", "bound", "overlap"):
        assert flags(plain) == ["--no-schedule"], plain  # adaptation is part of scheduling

    def worker_args(a):  # from -np on, and the warm-up apart
        rest = a[a.index("-np"):]
        i = rest.index("--warmup") + 1
        return rest[:i] + rest[i + 1:], int(rest[i])

    for fixed_mode, adapting_mode in (("bsrun-fixed", "bsrun"), ("bsrun-horovod-fixed", "bsrun-horovod")):
        fixed, adapting = args(fixed_mode), args(adapting_mode)  # the same worker and script
        assert fixed[fixed.index("--mode") + 1] == adapting_mode
        (fixed_rest, fixed_warmup), (adapting_rest, adapting_warmup) = worker_args(fixed), worker_args(adapting)
        assert fixed_rest == adapting_rest and adapting_warmup == fixed_warmup == 1  # the runner decides

    # compared side by side, every mode waits out the adaptive one's first search
    assert compared_warmup(["ddp", "bsrun-fixed", "bsrun", "bound"], 2) == 2 + SEARCH_STEPS
    assert compared_warmup(["ddp", "bsrun-horovod"], 0) == SEARCH_STEPS
    assert compared_warmup(["ddp", "bsrun-fixed", "bsrun:tic", "bound"], 2) == 2  # nothing adapts


@pytest.mark.slow
def test_the_replay_mode_replays_a_profile_under_a_perfect_schedule(tmp_path):
    modes = ["ddp", "bound", "replay"]
    records, saved, text = bench(tmp_path, [None], modes)
    check(records, saved, text, None, modes)
    by_mode = {r["mode"]: r for r in records}
    replay = by_mode["replay"]
    assert replay["launched_as"] == ["replayed"]
    ((profiled, replayed),) = replay["replay_self_check"]  # the profiled run's median, its own replay
    assert profiled > 0 and replayed > 0
    assert by_mode["ddp"]["replay_self_check"] is None and by_mode["ddp"]["replay_breakdown"] is None
    ((first, *_, last),) = replay["replay_breakdown"]  # from the perfect schedule to the profiled point
    assert first[1] == pytest.approx(replay["median_step_s"]) and last[1] == pytest.approx(replayed)
    assert "from a perfect schedule to bsrun-fixed's point" in text
    gain = replay["attainable_replay"]
    assert all(r["attainable_replay"] == gain for r in records)
    if gain > 0:  # its sign is the machine's noise at 3 steps of a tiny model
        assert replay["captured_replay"] == pytest.approx(1.0) and by_mode["ddp"]["captured_replay"] == 0
        assert any("(replay)" in line for line in text.splitlines() if line.startswith("┃")), text  # its columns
    else:
        assert all(r["captured_replay"] is None for r in records)


def test_adaptation_decisions_inside_the_timed_steps_are_listed_and_the_first_keep_found():
    switches = [{"step": 2, "why": "explore: timing the starting point"},
                {"step": 14, "why": "keep: fastest median step 0.5 s of 0.5, 0.6"},
                {"step": 30, "why": "drift: step 0.9 s against 0.5 s when kept; re-timing it and searching again"}]
    run = {"ranks": [{"rank": 1, "adapt": {"switches": switches[:1]}}, {"rank": 0, "adapt": {"switches": switches}}]}
    assert _late_decisions(run, 16) == [f"step 30: {switches[2]['why']}"]  # rank 0's, from the warm-up's end on
    assert _late_decisions(run, 14) == [f"step 14: {switches[1]['why']}", f"step 30: {switches[2]['why']}"]
    assert _late_decisions(None, 3) == [] and _late_decisions({"ranks": [{"rank": 0}]}, 3) == []
    assert _first_keep(run) == 14 and _first_keep(None) is None  # where the first search ended


def test_attainable_gain_and_captured_are_shares_of_ddp_to_bound():
    def runs(**medians):
        return [RunResult(mode, [t, t, t], {"compute_times": [0.3] * 3, "comm_times": [t] * 3}
                          if mode == "bound" else {}) for mode, t in medians.items()]

    modes = ["ddp", "bsrun", "bsrun-fixed", "bound"]
    recs = {r["mode"]: r for r in summarise("tiny", None, 2, 3, runs(
        ddp=1.0, bsrun=0.7, **{"bsrun-fixed": 1.2}, bound=0.6), modes)}
    assert all(r["attainable_gain"] == pytest.approx(0.4) for r in recs.values())
    assert recs["bsrun"]["captured"] == pytest.approx(0.75)  # 0.3 of the 0.4 s DDP could lose
    assert recs["bsrun-fixed"]["captured"] == pytest.approx(-0.5)  # slower than DDP
    assert recs["ddp"]["captured"] == pytest.approx(0.0) and recs["bound"]["captured"] == pytest.approx(1.0)
    assert recs["bound"]["compute_part_s"] == pytest.approx(0.3) and recs["bound"]["comm_part_s"] == 0.6
    assert recs["bsrun"]["compute_part_s"] is None and recs["bsrun"]["comm_part_s"] is None

    # the bound measured at or above ddp, or a hair below (noise, or nothing to gain): no share to take
    for bound in (0.9995, 1.0, 1.1):
        recs = summarise("tiny", None, 2, 3, runs(ddp=1.0, bsrun=0.9, bound=bound), ["ddp", "bsrun", "bound"])
        assert all(r["attainable_gain"] == pytest.approx(1.0 - bound) and r["captured"] is None for r in recs)
    # without ddp or without the bound: neither
    for medians in (dict(bsrun=0.9, bound=0.6), dict(ddp=1.0, bsrun=0.9)):
        recs = summarise("tiny", None, 2, 3, runs(**medians), list(medians))
        assert all(r["attainable_gain"] is None and r["captured"] is None for r in recs)
    # a failed mode has neither captured nor a median
    failed = RunResult("bsrun", error="exited with code 1")
    recs = summarise("tiny", None, 2, 3, [*runs(ddp=1.0, bound=0.5), failed], ["ddp", "bsrun", "bound"])
    assert recs[1]["captured"] is None and recs[1]["attainable_gain"] == pytest.approx(0.5)


def test_off_a_terminal_the_bench_table_prints_whole():
    """Piped into a log, rich would wrap at 80 columns and cut labels ("bandw…", "bsrun…")."""
    modes = ("ddp", "horovod", "bsrun-horovod", "bound")
    records = [{"model": "vgg16", "bandwidth": bandwidth, "mode": mode, "world_size": 2, "batch": 32,
                "params": 138_357_544, "grad_bytes": 553_430_176, "median_step_s": 1.2345, "spread": [1.1, 1.3],
                "step_iqr_s": 0.01, "repeats": 3, "failed_repeats": 0, "speedup_vs_ddp": 1.0,
                "speedup_vs_horovod": 1.1, "speedup_vs_ps": None, "efficiency": 0.9,
                "attainable_gain": 0.123, "captured": -0.25}
               for bandwidth in (None, "1gbit") for mode in modes]
    log = io.StringIO()  # not a terminal
    new_console(file=log).print(bench_table("vgg16", records))
    text = log.getvalue()
    assert "…" not in text, text
    lines = text.splitlines()
    for label in ("bandwidth", "mode", "vs horovod", "efficiency", "attainable", "captured", "repeats"):
        assert any(label in line for line in lines if line.startswith("┃")), text
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == 8, text  # one line per row: nothing wrapped
    for i, (row, mode) in enumerate(zip(rows, modes * 2)):
        cells = [c.strip() for c in row.split("│")]
        assert cells[1] == ("loopback" if i < 4 else "1gbit") and cells[2] == mode, row
        assert cells[-3] == "-25%", row
        assert cells[-4] == ("12%" if i % 4 == 0 else ""), row  # the group's gain, once per group
    assert sum(line.startswith("├") for line in lines) == 1, text  # a line between the two groups
