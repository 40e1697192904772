"""A worker's sign of life for the launcher's watchdog (bsrun/launch/watchdog.py).

A daemon thread touches `<report dir>/heartbeat-<rank>` every few seconds. It needs the
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


def path_of(folder: Path, rank: int) -> Path:
    return Path(folder) / f"heartbeat-{rank}"


def start(rank: int) -> None:
    folder = worker_setting(REPORT_DIR_ENV)
    if not folder or not Path(folder).is_dir():
        return
    path = path_of(Path(folder), rank)
    _FILE.append(path)
    stop = threading.Event()

    def beat():
        while not stop.wait(PERIOD_S):
            try:
                path.touch()
            except OSError:
                return  # the launcher removed the folder: the launch is over
    path.touch()
    threading.Thread(target=beat, name="bsrun-heartbeat", daemon=True).start()


def stop() -> None:
    for path in _FILE:
        path.unlink(missing_ok=True)
    _FILE.clear()
