"""A worker's sign of life for the launcher's watchdog (bsrun/launch/watchdog.py).

A daemon thread touches `<report dir>/heartbeat-<rank>` every second. It needs the
Python interpreter, so a rank stuck in native code that holds the GIL (the way Horovod's
blocking wait sleeps), or stopped altogether, goes quiet, while one that merely computes,
evaluates or waits in a collective keeps beating (the collective's own timeout covers
that). The file goes when the rank writes its report at exit.
"""

import threading
from pathlib import Path

from bsrun.config import REPORT_DIR_ENV, worker_setting

PERIOD_S = 1.0
_FILE: list[Path] = []
_STOPPED = threading.Event()
_LOCK = threading.Lock()  # no beat between stop()'s unlink and the exit: it would leave a stale file


def start(rank: int) -> None:
    folder = worker_setting(REPORT_DIR_ENV)
    if not folder or not Path(folder).is_dir():
        return
    path = Path(folder) / f"heartbeat-{rank}"
    _FILE.append(path)

    def beat():
        while not _STOPPED.wait(PERIOD_S):
            with _LOCK:
                if _STOPPED.is_set():
                    return
                try:
                    path.touch()
                except OSError:
                    return  # the launcher removed the folder: the launch is over
    path.touch()
    threading.Thread(target=beat, name="bsrun-heartbeat", daemon=True).start()


def stop() -> None:
    """No more beats, and the file goes: this rank is exiting, not hung."""
    with _LOCK:
        _STOPPED.set()
        for path in _FILE:
            path.unlink(missing_ok=True)
        _FILE.clear()
