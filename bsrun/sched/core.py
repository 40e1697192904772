"""The scheduler core: a priority order, a credit window and cross-rank agreement.

Framework-neutral: it knows partitions only by id (lower id = more urgent) and size, and
talks to a `CommBackend` that moves the bytes. One thread per scheduler; it sleeps on a
condition variable, never polls.

Agreement without a leader: every collective carries this rank's readiness bitmap of
the round's partitions and returns their sum, so after each completion all ranks hold
the same picture of what is ready everywhere (sum == world size). Each next choice is a
pure function of that shared picture and of sizes: the most urgent partition known
ready everywhere, while the bytes in flight stay within the credit. So every rank issues
the same collectives in the same order whatever its timing, with no round trip per
decision. Only when nothing is known ready everywhere and nothing is in flight does a
rank send a bitmap alone (a negotiation), and only once it has news to tell.

Rounds: one round is one synchronising backward pass; every partition is sent once per
round. A partition's readiness is counted, not flagged, so a hook of the next round can
arrive before this thread has closed the current one.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Protocol, Sequence


class CommBackend(Protocol):
    world_size: int

    def post(self, pid: int, ready: Sequence[int]) -> object:
        """Start partition `pid`'s collective, carrying this rank's readiness bitmap."""

    def negotiate(self, ready: Sequence[int]) -> object:
        """Start a collective of the readiness bitmap alone."""

    def wait(self, handle) -> Sequence[int]:
        """Block until done; finish the partition (if any); return the summed bitmap."""


class SchedulerClosed(RuntimeError):
    pass


class Scheduler:
    def __init__(self, backend: CommBackend, sizes: Sequence[int], credit_bytes: int,
                 on_complete: Callable[[int], None], on_error: Callable[[BaseException], None],
                 name: str = "bsrun-comm"):
        self.backend = backend
        self.sizes = list(sizes)
        self.credit = credit_bytes
        self.on_complete = on_complete
        self.on_error = on_error
        self._ready = [0] * len(self.sizes)  # times each partition was marked ready
        self._cv = threading.Condition()
        self._closing = False
        self.stats = {"rounds": 0, "partitions": 0, "bytes": 0, "negotiations": 0}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def mark_ready(self, pid: int) -> None:
        with self._cv:
            self._ready[pid] += 1
            self._cv.notify()

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # --- the communication thread ---------------------------------------------------

    def _bitmap(self, round_: int) -> list[int]:
        return [1 if count > round_ else 0 for count in self._ready]

    def _run(self) -> None:
        try:
            round_ = 0
            while True:
                with self._cv:
                    while not self._closing and not any(c > round_ for c in self._ready):
                        self._cv.wait()
                    if self._closing:
                        return
                self._run_round(round_)
                round_ += 1
                self.stats["rounds"] = round_
        except SchedulerClosed:
            return
        except BaseException as e:  # reported to the training thread, which raises it
            self.on_error(e)

    def _run_round(self, round_: int) -> None:
        world = self.backend.world_size
        unsent = set(range(len(self.sizes)))
        known: set[int] = set()       # ready on every rank, as of the last completion
        inflight: deque = deque()
        inflight_bytes = 0

        def learn(counts):
            known.update(p for p, c in enumerate(counts) if c >= world)

        while unsent or inflight:
            candidates = known & unsent
            choice = min(candidates) if candidates else None
            if choice is not None and (not inflight or inflight_bytes + self.sizes[choice] <= self.credit):
                with self._cv:
                    bitmap = self._bitmap(round_)
                inflight.append((choice, self.backend.post(choice, bitmap)))
                unsent.discard(choice)
                inflight_bytes += self.sizes[choice]
                continue
            if inflight:
                pid, handle = inflight.popleft()
                learn(self.backend.wait(handle))
                inflight_bytes -= self.sizes[pid]
                self.stats["partitions"] += 1
                self.stats["bytes"] += self.sizes[pid]
                self.on_complete(pid)
                continue
            with self._cv:  # nothing to send that all ranks have: wait for news, then tell
                while not self._closing and not any(
                        self._ready[p] > round_ for p in unsent - known):
                    self._cv.wait()
                if self._closing:
                    raise SchedulerClosed()
                bitmap = self._bitmap(round_)
            self.stats["negotiations"] += 1
            learn(self.backend.wait(self.backend.negotiate(bitmap)))
