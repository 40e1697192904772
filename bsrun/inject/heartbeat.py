"""A worker's sign of life for the launcher's watchdog, and its watch on the launcher.

A daemon thread touches `<report dir>/heartbeat-<rank>` every second
(bsrun/launch/watchdog.py reads it). It needs the Python interpreter, so a rank stuck in
native code that holds the GIL (the way Horovod's blocking wait sleeps), or stopped
altogether, goes quiet, while one that merely computes, evaluates or waits in a
collective keeps beating (the collective's own timeout covers that). The file goes when
the rank writes its report at exit.

The same thread watches the bsrun that started the launch (BSRUN_LAUNCHER_PID): a
launcher killed outright (SIGKILL, the OOM killer) cannot stop its workers, and a
foreign launcher it wrapped (torchrun) would keep them; so a worker whose launcher is
gone ends itself and the processes it started, within a beat or two. The process the
launcher started itself (the wrapped command, when it is Python) watches from its start,
worker or not (`watch_launcher`); other processes only once they become workers.
"""

import os
import sys
import threading
from pathlib import Path

import psutil

from bsrun.config import LAUNCHER_PID_ENV, REPORT_DIR_ENV, worker_setting

PERIOD_S = 1.0
_FILE: list[Path] = []
_RANK: list[int] = []                # this process's rank once it is a worker
_THREAD: list[threading.Thread] = []
_STOPPED = threading.Event()
_LOCK = threading.Lock()  # no beat between stop()'s unlink and the exit: it would leave a stale file


def _launcher() -> "psutil.Process | None":
    pid = worker_setting(LAUNCHER_PID_ENV)
    try:
        return psutil.Process(int(pid)) if pid else None
    except (ValueError, psutil.Error):
        return None


def _alive(process: psutil.Process) -> bool:
    """Running and not a zombie (a killed launcher its own parent has not reaped yet)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _end_orphaned(rank: int | None, launcher_pid: int) -> None:
    who = f"rank {rank}" if rank is not None else f"pid {os.getpid()}"
    try:
        print(f"bsrun: {who}: the launcher (pid {launcher_pid}) is gone; ending this "
              f"{'worker' if rank is not None else 'process'}", file=sys.stderr, flush=True)
    except OSError:
        pass  # the launcher held the other end of our output
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
    os._exit(1)


def _beat(launcher: "psutil.Process | None") -> None:
    while not _STOPPED.wait(PERIOD_S):
        if launcher is not None and not _alive(launcher):
            _end_orphaned(_RANK[0] if _RANK else None, launcher.pid)
        with _LOCK:
            if _STOPPED.is_set():
                return
            for path in _FILE:
                try:
                    path.touch()
                except OSError:
                    pass  # the launcher removed the folder: the launch is ending


def _ensure_thread() -> bool:
    """The one thread of this process that beats and watches; False if there is nothing to do."""
    with _LOCK:
        if _THREAD:
            return True
        launcher = _launcher()
        if launcher is None and not _FILE:
            return False
        _THREAD.append(threading.Thread(target=_beat, args=(launcher,), name="bsrun-heartbeat", daemon=True))
    _THREAD[0].start()
    return True


def watch_launcher() -> None:
    """Only the watch on the launcher (a process it started itself that is no worker yet)."""
    _ensure_thread()


def start(rank: int) -> None:
    """This worker beats `heartbeat-<rank>` (and watches the launcher), from now on."""
    folder = worker_setting(REPORT_DIR_ENV)
    path = Path(folder) / f"heartbeat-{rank}" if folder and Path(folder).is_dir() else None
    with _LOCK:
        _RANK.append(rank)
        if path is not None:
            _FILE.append(path)
            path.touch()
    _ensure_thread()


def _forget_in_forked_child() -> None:
    """A forked child has no beat thread, and maybe a lock its parent's thread held: start afresh."""
    global _LOCK, _STOPPED
    _LOCK, _STOPPED = threading.Lock(), threading.Event()
    _THREAD.clear()
    _FILE.clear()
    _RANK.clear()


os.register_at_fork(after_in_child=_forget_in_forked_child)


def stop() -> None:
    """No more beats, and the file goes: this rank is exiting, not hung."""
    with _LOCK:
        _STOPPED.set()
        for path in _FILE:
            path.unlink(missing_ok=True)
        _FILE.clear()
