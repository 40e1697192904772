"""Each rank's part of the run summary, written once at exit for the launcher to merge."""

import os
import sys
from pathlib import Path

from bsrun.config import REPORT_DIR_ENV, worker_setting
from bsrun.fsutil import atomic_write_json
from bsrun.inject import heartbeat


def rank_report(rank: int) -> dict:
    report = {"rank": rank, "pid": os.getpid(), "mode": "off", "steps": 0, "tasks": 0,
              "partitions": 0, "bytes": 0, "notes": []}
    runtime = sys.modules.get("bsrun.inject.runtime")
    if runtime is not None:
        report.update(runtime.counters())
    return report


def write_rank_report(rank: int) -> None:
    """At exit (also os._exit's, which call it first): the report, and the heartbeat stops."""
    heartbeat.stop()
    folder = worker_setting(REPORT_DIR_ENV)
    if not folder or not os.path.isdir(folder):
        return
    try:
        atomic_write_json(Path(folder) / f"rank-{rank}.json", rank_report(rank))
    except OSError as e:
        print(f"bsrun: warning: could not write the run report of rank {rank}: {e}", file=sys.stderr)
