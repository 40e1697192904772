"""Starting, watching and stopping worker processes.

A `WorkerGroup` owns its children: each runs in its own session (so its own process
group), which lets us signal a worker together with everything it started, and
nothing but what we started. The first worker that fails ends the group: the others get
SIGTERM, then SIGKILL after the grace period, as torchrun's agent does.

Services (parameter servers) are processes that serve the workers: they start first, one
that fails ends the group like a failing worker, and they are stopped once every worker
has exited. Their exit codes are not the job's.
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
    service: str | None = None  # a service's name ("parameter server 0"); None for a worker

    @property
    def name(self) -> str:
        return self.service or f"rank {self.rank}"


@dataclass
class GroupResult:
    exit_codes: dict[int, int | None] = field(default_factory=dict)  # of the workers, by rank
    failed_rank: int | None = None   # the worker that failed first
    failed_service: str | None = None  # or the service
    service_code: int | None = None    # and its exit code
    hung_rank: int | None = None       # the rank the watchdog found hung
    interrupted_by: int | None = None  # the signal that stopped bsrun, if any

    @property
    def exit_code(self) -> int:
        if self.hung_rank is not None:
            return 1
        if self.failed_service is not None:
            return self.service_code
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
        self.procs: dict[int, subprocess.Popen] = {}  # by rank; services (keyed after the ranks) first
        self._pumps: list[threading.Thread] = []
        self._stop_signal: int | None = None

    def start(self) -> None:
        for spec in sorted(self.specs, key=lambda s: s.service is None):
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

    def wait(self, watchdog=None) -> GroupResult:
        """Watch until all exit, one fails, the watchdog finds a rank hung, or a stop is
        requested; always tear down."""
        result = GroupResult()
        services = {s.rank: s.service for s in self.specs if s.service is not None}
        workers = [s.rank for s in self.specs if s.service is None]
        try:
            while True:
                for rank, proc in self.procs.items():
                    code = proc.poll()
                    if code is not None:
                        result.exit_codes.setdefault(rank, returncode_to_exit(code))
                if all(result.exit_codes.get(r) == 0 for r in workers):
                    break  # the job is done; services that ended with their peers do not count
                dead = [r for r in services if result.exit_codes.get(r, 0) != 0]
                failed = [r for r in workers if result.exit_codes.get(r, 0) != 0]
                if dead:  # a dead server is the cause of the workers' failures, not their effect
                    result.failed_service, result.service_code = services[dead[0]], result.exit_codes[dead[0]]
                    break
                if failed:
                    result.failed_rank = failed[0]
                    break
                if self._stop_signal is not None:
                    result.interrupted_by = self._stop_signal
                    break
                if watchdog is not None and (hung := watchdog.check()) is not None:
                    result.hung_rank = hung
                    break
                time.sleep(self.poll)
        finally:
            self.stop()
        for rank, proc in self.procs.items():
            result.exit_codes.setdefault(rank, returncode_to_exit(proc.returncode))
        for rank in services:
            del result.exit_codes[rank]
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
