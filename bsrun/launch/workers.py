"""Starting, watching and stopping worker processes.

A `WorkerGroup` owns its children: each runs in its own session (so its own process
group), which lets us signal a worker together with everything it started, and
nothing but what we started. The first worker that fails ends the group: the others get
SIGTERM, then SIGKILL after the grace period, as torchrun's agent does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field


@dataclass
class WorkerSpec:
    rank: int
    argv: list[str]
    env: dict[str, str]
    prefix: str | None = None  # "[0] " to tag each output line with the rank; None: pass through


@dataclass
class GroupResult:
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    failed_rank: int | None = None
    interrupted_by: int | None = None  # the signal that stopped bsrun, if any

    @property
    def exit_code(self) -> int:
        if self.failed_rank is not None:
            return self.exit_codes[self.failed_rank]
        if self.interrupted_by is not None:
            return 128 + self.interrupted_by
        return 0


def returncode_to_exit(code: int) -> int:
    """A worker killed by signal N is reported as the shell does: 128 + N."""
    return 128 - code if code < 0 else code


def _pump(stream, out, prefix: bytes) -> None:
    """Copy a worker's output line by line, tagging each line with its rank."""
    for line in iter(stream.readline, b""):
        out.buffer.write(prefix + line)
        out.flush()
    stream.close()


class WorkerGroup:
    def __init__(self, specs: list[WorkerSpec], grace: float = 10.0, poll: float = 0.05):
        self.specs = specs
        self.grace = grace
        self.poll = poll
        self.procs: dict[int, subprocess.Popen] = {}
        self._pumps: list[threading.Thread] = []
        self._stop_signal: int | None = None

    def start(self) -> None:
        for spec in self.specs:
            piped = spec.prefix is not None
            try:
                proc = subprocess.Popen(
                    spec.argv, env=spec.env, stdin=subprocess.DEVNULL, start_new_session=True,
                    stdout=subprocess.PIPE if piped else None,
                    stderr=subprocess.PIPE if piped else None)
            except OSError:
                self.stop()
                raise
            self.procs[spec.rank] = proc
            if piped:
                tag = spec.prefix.encode()
                for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                    t = threading.Thread(target=_pump, args=(stream, out, tag), daemon=True)
                    t.start()
                    self._pumps.append(t)

    def request_stop(self, signum: int) -> None:
        """Called from bsrun's signal handler: the watch loop tears the group down."""
        self._stop_signal = signum

    def wait(self, on_tick=None) -> GroupResult:
        """Watch until all exit, one fails, or a stop is requested; always tear down."""
        result = GroupResult()
        try:
            while True:
                for rank, proc in self.procs.items():
                    code = proc.poll()
                    if code is not None and rank not in result.exit_codes:
                        result.exit_codes[rank] = returncode_to_exit(code)
                        if code != 0 and result.failed_rank is None:
                            result.failed_rank = rank
                if result.failed_rank is not None or len(result.exit_codes) == len(self.procs):
                    break
                if self._stop_signal is not None:
                    result.interrupted_by = self._stop_signal
                    break
                if on_tick is not None:
                    on_tick()
                time.sleep(self.poll)
        finally:
            self.stop()
        for rank, proc in self.procs.items():
            result.exit_codes.setdefault(rank, returncode_to_exit(proc.returncode))
        for t in self._pumps:
            t.join(timeout=2)
        return result

    def _signal_groups(self, signum: int) -> None:
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signum)  # the worker's own group: it and its children
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self) -> None:
        """SIGTERM every worker's process group, SIGKILL what is left after the grace period.

        Also run after a clean exit: grandchildren a worker left in its group go too.
        """
        if not self.procs:
            return
        self._signal_groups(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(self.poll)
        self._signal_groups(signal.SIGKILL)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
