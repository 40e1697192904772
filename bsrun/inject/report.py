"""Each rank's part of the run summary, written once at exit for the launcher to merge.

`rank-<rank>-<pid>.json` in the launch's report folder: two processes may claim one rank
(a launcher's rank in the environment, then workers its script spawned), and the launcher
keeps the one that did the most (bsrun/launch/summary.py).
"""

import os
import sys
from pathlib import Path

from bsrun.config import REPORT_DIR_ENV, worker_setting
from bsrun.fsutil import atomic_write_json
from bsrun.inject import heartbeat, state


def rank_report(rank: int) -> dict:
    return {"rank": rank, "pid": os.getpid(), **state.counters()}


def write_rank_report(rank: int) -> None:
    """At exit (also os._exit's, which call it first): the report, and the heartbeat stops."""
    heartbeat.stop()
    folder = worker_setting(REPORT_DIR_ENV)
    if not folder or not os.path.isdir(folder):
        return
    try:
        atomic_write_json(Path(folder) / f"rank-{rank}-{os.getpid()}.json", rank_report(rank))
    except OSError as e:
        print(f"bsrun: warning: could not write the run report of rank {rank}: {e}", file=sys.stderr)
