"""The run summary: what each rank reported at exit, merged by the launcher, and read back.

Kept as `.bsrun/last-run.json` and `.bsrun/runs/<time>.json`; one line on the terminal.
A program that ran bsrun as a child (bench, tune) reads what its launch did from it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bsrun.fsutil import atomic_write_json

RUNS_DIR = Path(".bsrun") / "runs"
LAST_RUN = Path(".bsrun") / "last-run.json"


MODES = ("unknown", "off", "fallback", "scheduled")  # how much a rank did under bsrun, least first


def _weight(report: dict) -> tuple:
    mode = report.get("mode")
    return MODES.index(mode) if mode in MODES else 0, report.get("steps") or 0


def read_rank_reports(report_dir: Path) -> dict[int, dict]:
    """Every worker's report (`rank-R-PID.json`), whoever started it; of two processes
    that claimed one rank, the one that did the most."""
    reports = {}
    for path in sorted(Path(report_dir).glob("rank-*.json")):
        try:
            report = json.loads(path.read_text())
            rank = int(report["rank"])
        except (ValueError, KeyError, TypeError, OSError):
            continue  # a rank killed mid-write leaves no valid report; its exit code still counts
        if rank not in reports or _weight(report) > _weight(reports[rank]):
            reports[rank] = report
    return reports


def build_summary(command, config, kind, exit_code, exit_codes, reports, started, ended, pids=None) -> dict:
    """`pids`: the launcher's own record of its workers, for the ranks that wrote no report.
    A local launch lists the ranks it started; a wrap, the workers that reported."""
    ranks = []
    for rank in sorted((set(exit_codes) if kind == "local" else set()) | set(reports)):
        entry = {"rank": rank, **reports.get(rank, {"mode": "unknown"})}
        if kind == "local":
            entry["exit_code"] = exit_codes.get(rank)
            if rank in (pids or {}):
                entry.setdefault("pid", pids[rank])
        ranks.append(entry)
    return {
        "command": list(command), "kind": kind, "config": config.as_dict(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "duration_s": round(ended - started, 3),
        "exit_code": exit_code,
        "ranks": ranks,
    }


def save_summary(summary: dict) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{int(time.time() * 1000) % 1000:03d}"
    path = RUNS_DIR / f"{stamp}.json"
    atomic_write_json(path, summary)
    atomic_write_json(LAST_RUN, summary)
    return path


def read_last_run(folder: Path = Path("."), since: float | None = None) -> dict | None:
    """The summary the last launch in `folder` left; None if there is none, it is
    unreadable, or it was written before `since` (a time.time(): by an older launch)."""
    path = Path(folder) / LAST_RUN
    try:
        if since is not None and path.stat().st_mtime < since:
            return None
        run = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return run if isinstance(run, dict) and isinstance(run.get("ranks"), list) else None


def rank_modes(run: dict) -> list[str]:
    """How the ranks ran: scheduled, fallback, off (unknown: a rank that wrote no report)."""
    return sorted({r.get("mode", "unknown") for r in run["ranks"]})


def decider_adaptation(run: dict | None) -> dict | None:
    """Rank 0's `adapt` entry (its adaptation decides for every rank), or None."""
    return next((r.get("adapt") for r in (run or {}).get("ranks", []) if r.get("rank") == 0), None)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"


def one_line(summary: dict) -> str:
    ranks = summary["ranks"]
    modes = rank_modes(summary)
    if not ranks:
        return (f"bsrun: no data-parallel worker (no process built a DDP model or an hvd.DistributedOptimizer), "
                f"{summary['duration_s']:.1f} s, exit code {summary['exit_code']} (summary in {LAST_RUN})")
    head = f"bsrun: {len(ranks)} rank{'s' if len(ranks) != 1 else ''}, {summary['duration_s']:.1f} s, mode {'/'.join(modes)}"
    reported = [r for r in ranks if "steps" in r and r.get("mode") != "off"]
    if reported:
        r0 = min(reported, key=lambda r: r["rank"])
        head += (f"; rank {r0['rank']}: {r0['steps']} steps, {r0['partitions']} partitions, "
                 f"{_human_bytes(r0['bytes'])} communicated")
    return head + f" (summary in {LAST_RUN})"
