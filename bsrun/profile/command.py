"""What `bsrun profile`, `profile show` and `profile whatif` do.

`run`: launch the job with recording on (BSRUN_PROFILE_* in every worker's environment),
then, whether it ended, failed or was stopped by Ctrl-C, merge what the ranks wrote into
DIR/trace.json, analyse it into DIR/summary.json and DIR/timeline.png, and print the
tables. Every file is written atomically, so an interrupted merge leaves the old one.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from bsrun.config import PROFILE_DIR_ENV, PROFILE_STEPS_ENV, PROFILE_WARMUP_ENV, parse_credit, parse_size
from bsrun.console import new_console
from bsrun.errors import BsrunError
from bsrun.fsutil import atomic_write_json
from bsrun.profile import analysis, report, timeline, trace, whatif

PROFILE_ROOT = Path(".bsrun") / "profile"
SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "timeline.png"


def new_folder() -> Path:
    return PROFILE_ROOT / time.strftime("%Y%m%d-%H%M%S")


def latest_folder() -> Path:
    folders = sorted(p for p in PROFILE_ROOT.glob("*") if p.is_dir()) if PROFILE_ROOT.is_dir() else []
    if not folders:
        raise BsrunError(f"no profile in {PROFILE_ROOT}; run `bsrun profile -np 2 python train.py` first")
    return folders[-1]


def _say(message: str) -> None:
    print(f"bsrun: {message}", file=sys.stderr, flush=True)


# --- analysis of a trace -----------------------------------------------------------------


def whatif_summary(trace_obj: dict) -> dict:
    model = whatif.fit(trace_obj)
    p = model.profiled
    out = {"alpha_ms": model.alpha * 1e3, "beta_s_per_byte": model.beta,
           "gbit_per_s": 8e-9 / model.beta if model.beta else float("inf"),
           "decision_ms": model.decision * 1e3, "update_ms_per_mb": model.update_b * 1e9,
           "transfers": p.get("transfers", 0)}
    if p.get("measured_step_s"):
        predicted = whatif.predict(model, p["partition"] or 1, p["credit"] or 1, p["scheduled"])
        out["self_check"] = {"predicted_ms": predicted * 1e3, "measured_ms": p["measured_step_s"] * 1e3,
                             "error_pct": 100.0 * (predicted / p["measured_step_s"] - 1.0)}
    out["perfect_schedule_ms"] = whatif.best_schedule(model)["step_s"] * 1e3
    return out


def summarise(folder: Path, trace_obj: dict) -> dict:
    """summary.json and timeline.png of a merged trace; returns the summary."""
    summary = analysis.analyse(trace_obj)
    try:
        summary["whatif"] = whatif_summary(trace_obj)
    except ValueError as e:
        summary["notes"].append(f"no what-if model: {e}")
    views = analysis.rank_views(trace_obj)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".timeline.", suffix=".png")
    os.close(fd)
    try:
        window = timeline.draw(views, Path(tmp))
        if window is not None:
            os.replace(tmp, Path(folder) / TIMELINE_FILE)
            summary["timeline_iteration"] = window[2]
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    atomic_write_json(Path(folder) / SUMMARY_FILE, summary)
    return summary


def print_summary(summary: dict, folder: Path, console: Console) -> None:
    console.print(report.layer_table(summary))
    console.print(report.iteration_table(summary))
    lines = report.straggler_lines(summary) + report.model_lines(summary)
    for line in lines + [f"note: {n}" for n in summary["notes"]]:
        console.print(line, highlight=False, markup=False)
    files = [folder / trace.TRACE_FILE, folder / SUMMARY_FILE]
    if (folder / TIMELINE_FILE).exists():
        files.append(folder / TIMELINE_FILE)
    console.print(f"{', '.join(map(str, files))} (open the trace in https://ui.perfetto.dev or chrome://tracing)",
                  highlight=False, markup=False)


# --- the commands --------------------------------------------------------------------------


def run(plan, folder: Path | None, warmup: int, steps: int | None, as_json: bool) -> int:
    from bsrun.launch.agent import launch

    folder = Path(folder) if folder is not None else new_folder()
    folder.mkdir(parents=True, exist_ok=True)
    for old in [*folder.glob("rank-*.jsonl"), folder / trace.TRACE_FILE, folder / SUMMARY_FILE]:
        old.unlink(missing_ok=True)
    plan.base_env.update({PROFILE_DIR_ENV: str(folder.resolve()), PROFILE_WARMUP_ENV: str(warmup),
                          PROFILE_STEPS_ENV: str(steps) if steps else ""})
    code = launch(plan)
    if not list(folder.glob("rank-*.jsonl")):
        _say(f"no rank recorded anything in {folder} (the job never imported torch under bsrun?)")
        return code or 1
    try:
        merged = trace.merge(folder, run={"command": list(plan.command), "exit_code": code})
        summary = summarise(folder, merged)
    except KeyboardInterrupt:
        _say(f"interrupted while merging; the ranks' recordings stay in {folder}: `bsrun profile show {folder}`")
        return 130
    if code != 0:
        _say(f"the job ended with exit code {code}; the trace holds what was recorded until then")
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary, folder, new_console())
    return code


def show(folder: Path | None, as_json: bool) -> int:
    folder = Path(folder) if folder is not None else latest_folder()
    summary = summarise(folder, trace.load(folder))
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary, folder, new_console())
    return 0


def _config_label(scheduled: bool, partition: int, credit: int) -> str:
    if not scheduled:
        return "unscheduled (DDP buckets)"
    return f"scheduled, partition {partition} B, credit {credit} B"


def what_if(folder: Path | None, partition: str | None, credit: str | None, schedule: bool | None,
            as_json: bool) -> int:
    folder = Path(folder) if folder is not None else latest_folder()
    try:
        model = whatif.fit(trace.load(folder))
    except ValueError as e:
        raise BsrunError(f"{folder}: {e}") from None
    p = model.profiled
    try:
        part = parse_size(partition) if partition is not None else (p["partition"] or parse_size("4MiB"))
        cred = parse_credit(credit if credit is not None else p.get("credit_spec") or "2x").resolve(part)
    except ValueError as e:
        raise BsrunError(f"--partition/--credit must be {e}") from None
    scheduled = p["scheduled"] if schedule is None else schedule
    asked = whatif.predict_detail(model, part, cred, scheduled)
    base = whatif.predict_detail(model, p["partition"] or part, p["credit"] or cred, p["scheduled"])
    rows = [{"config": "profiled: " + _config_label(p["scheduled"], p["partition"], p["credit"]),
             "predicted_ms": base["step_s"] * 1e3, "collectives": base["collectives"], "vs_profiled": 1.0},
            {"config": _config_label(scheduled, part, cred), "predicted_ms": asked["step_s"] * 1e3,
             "collectives": asked["collectives"], "vs_profiled": base["step_s"] / asked["step_s"]}]
    result = {"predicted_step_s": asked["step_s"], "config": {"scheduled": scheduled, "partition": part, "credit": cred},
              "profiled": {**p, "predicted_step_s": base["step_s"]}, "replay": asked}
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    console = new_console()
    console.print(report.whatif_table(rows))
    if p.get("measured_step_s"):
        console.print(f"measured step of the profiled run: {p['measured_step_s'] * 1e3:.1f} ms", highlight=False)
    return 0
