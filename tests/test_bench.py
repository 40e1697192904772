"""The benchmark measures every mode with real launches and reports what DESIGN.md asks.

Each test runs `run_bench` on the `tiny` model with 2 real gloo ranks; no mocks.
"""

import io
import json
import os
import sys

import pytest
from rich.console import Console

from bsrun.bench.runner import MODES, RunResult, bench_table, run_bench, run_once, summarise
from bsrun.console import new_console
from bsrun.errors import BsrunError

REQUIRED = {"model", "bandwidth", "mode", "median_step_s", "spread", "speedup_vs_ddp",
            "efficiency", "repeats", "steps"}


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
    assert saved["results"] == records
    assert all(REQUIRED <= rec.keys() for rec in saved["results"])
    by_mode = {r["mode"]: r for r in records}
    assert by_mode["ddp"]["speedup_vs_ddp"] == pytest.approx(1.0)
    assert "tiny" in text and "ddp" in text


@pytest.mark.slow
def test_every_mode_on_loopback(tmp_path):
    pytest.importorskip("horovod.torch", reason="the horovod modes need Horovod (scripts/install-horovod.sh)")
    records, saved, text = bench(tmp_path, [None], MODES)
    check(records, saved, text, None, MODES)
    by_mode = {r["mode"]: r for r in records}
    assert by_mode["bound"]["efficiency"] == pytest.approx(1.0)
    assert by_mode["horovod"]["speedup_vs_horovod"] == pytest.approx(1.0)
    for scheduled in ("bsrun", "bsrun-horovod"):
        assert by_mode[scheduled]["launched_as"] == ["scheduled"]
    for plain in ("ddp", "horovod"):
        assert by_mode[plain]["launched_as"] == ["off"]
    assert "vs horovod" in text


@pytest.mark.slow
def test_parameter_servers_and_every_order_side_by_side(tmp_path):
    modes = ["ddp", "ps", "bsrun", "bsrun:forward", "bsrun:tic", "bsrun:tac", "bsrun:fifo"]
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
    assert all(r["efficiency"] is None for r in records)  # bound was not run


def test_bad_arguments_fail_before_launching(tmp_path):
    with pytest.raises(BsrunError, match="unknown mode"):
        run_bench(["tiny"], 2, [None], ["fast"], 3, 1, 1, None, None, Console(file=io.StringIO()))
    with pytest.raises(BsrunError, match="rate such as"):
        run_bench(["tiny"], 2, ["fast"], ["ddp"], 3, 1, 1, None, None, Console(file=io.StringIO()))


def test_a_failed_run_is_reported_and_the_others_are_kept(tmp_path):
    out = tmp_path / "r.json"
    args = ["--no-schedule", "-np", "2", sys.executable, "-m", "bsrun.bench.worker", "--model", "tiny",
            "--mode", "ddp", "--steps", "0", "--out", str(out)]
    failed = run_once(args, "ddp", tmp_path, out, timeout=60)
    assert failed.error.startswith("exited with code 2"), failed.error
    assert "--steps and --batch must be at least 1" in failed.error  # the tail of its output
    ok = RunResult("ddp", [0.5, 0.7, 0.6], {"batch": 16, "params": 1, "grad_bytes": 4})
    (rec,) = summarise("tiny", None, 2, 3, [failed, ok], ["ddp"])
    assert rec["repeats"] == 1 and rec["failed_repeats"] == 1
    assert rec["median_step_s"] == pytest.approx(0.6) and rec["errors"] == ["exited with code 2"]


def test_off_a_terminal_the_bench_table_prints_whole():
    """Piped into a log, rich would wrap at 80 columns and cut labels ("bandw…", "bsrun…")."""
    records = [{"model": "vgg16", "bandwidth": None, "mode": mode, "world_size": 2, "batch": 32,
                "params": 138_357_544, "grad_bytes": 553_430_176, "median_step_s": 1.2345, "spread": [1.1, 1.3],
                "step_iqr_s": 0.01, "repeats": 3, "failed_repeats": 0, "speedup_vs_ddp": 1.0,
                "speedup_vs_horovod": 1.1, "speedup_vs_ps": None, "efficiency": 0.9}
               for mode in ("ddp", "horovod", "bsrun-horovod")]
    log = io.StringIO()  # not a terminal
    new_console(file=log).print(bench_table("vgg16", records))
    text = log.getvalue()
    assert "…" not in text, text
    lines = text.splitlines()
    for label in ("bandwidth", "mode", "vs horovod", "efficiency", "repeats"):
        assert any(label in line for line in lines if line.startswith("┃")), text
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == 3, text  # one line per row: nothing wrapped
    for row, mode in zip(rows, ("ddp", "horovod", "bsrun-horovod")):
        assert row.split("│")[1].strip() == "loopback" and row.split("│")[2].strip() == mode, row
