"""The launcher's watchdog: a rank whose heartbeat stops for --timeout seconds is hung.

Collectives have their own timeout inside the workers; this catches what they cannot: a
rank that no longer runs Python at all (native code holding the GIL, a stopped process).
Ranks beat through files in the launch's report folder (bsrun/inject/heartbeat.py); a rank
that has not started beating, or has exited, is not watched.
"""

from __future__ import annotations

import time
from pathlib import Path


class Watchdog:
    def __init__(self, folder: Path, timeout_s: float):
        self.folder = Path(folder)
        self.timeout_s = timeout_s
        self.hung: tuple[int, float] | None = None  # (rank, seconds without a heartbeat)

    def check(self) -> int | None:
        """The first rank quiet for longer than the timeout, or None."""
        now = time.time()
        for path in sorted(self.folder.glob("heartbeat-*")):
            try:
                quiet = now - path.stat().st_mtime
            except FileNotFoundError:
                continue  # it just exited
            if quiet > self.timeout_s:
                self.hung = (int(path.name.split("-")[1]), quiet)
                return self.hung[0]
        return None
