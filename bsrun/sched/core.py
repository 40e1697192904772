"""The scheduler core: a priority order, a credit window and cross-rank agreement.

Framework-neutral: it knows partitions only by id (lower id = more urgent) and size, and
talks to a `CommBackend` that moves the bytes. Two threads, both sleeping on one
condition variable: the control thread agrees with the other ranks and
issues collectives; the finisher hands each result back as it finishes (in order on one
gloo group; polled where the transport may finish them out of order, as Horovod does).

The issue rule itself is `next_to_issue` in bsrun/sched/task.py (the partition's life);
this module applies it to the picture the ranks agree on.

Agreement without a leader. All ranks take part in a sequence of small negotiations on
a channel of their own (not behind the gradient bytes): each rank contributes its
readiness bitmap of the round's partitions and its count of finished collectives, and
gets back the elementwise minimum. After each negotiation every rank holds the same
picture: which partitions are ready everywhere, and how many collectives have finished
everywhere. Every decision is a pure function of that picture: issue the most urgent
partition ready everywhere, while the bytes not yet finished everywhere stay within the
credit. So all ranks issue the same collectives in the same order whatever their timing.

When to negotiate: at once when this rank has news (a partition became ready, or, while
the credit is what holds issuing back, a collective finished); after a short pause when
others are behind this rank (they will have news); otherwise never. A rank that is the
minimum everywhere is what everyone waits for, and its own progress brings its news, so
this cannot deadlock.

A backend whose transport already matches collectives across ranks (Horovod, by name)
returns its own values from `negotiate`: then each rank decides by its own picture, and
the backend's docstring says why that cannot deadlock.

Steady rounds without negotiating. On a backend whose collectives are matched by their
posting order alone (`matched_by_order`: one gloo group), the order every rank issued in
a negotiated round is known to every rank, so later rounds replay it: each partition is
posted in that order once it is ready here and fits the credit beside this round's
unfinished bytes. A rank that posts first waits inside the collective for the others.
That takes the negotiations, and the decision latency they cost (a round trip through
the network's queue per decision), out of the hot path. It cannot deadlock: every
partition of a round becomes ready by the end of its backward pass whatever the
communication does, and the credit waits only for collectives earlier in the same order,
which every rank posts by the same argument. The order is re-negotiated every
RENEGOTIATE_EVERY rounds, and each scheduler (a new layout) negotiates its first round.

Rounds: one round is one synchronising backward pass; every partition is sent once per
round. Readiness is counted, not flagged, so a hook of the next round can arrive before
the current round is closed here.

An optional observer, `trace(event, pid, time_ns, nbytes)`, is told when a partition becomes
ready on this rank ("ready"), is handed to the backend ("post") and has finished ("finish"),
with time.perf_counter_ns() and bytes: at "finish" those its collective reduced (fewer than
the partition holds for an embedding table sent by its rows), otherwise its size in the
credit. `bsrun profile` records those. Off (None), it costs a test.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from bsrun.sched.task import next_to_issue


class CommBackend(Protocol):
    world_size: int
    in_order: bool  # collectives finish in the order they were posted (as on one gloo group)
    matched_by_order: bool  # ranks' collectives pair up by posting order alone: steady rounds replay it

    def post(self, pid: int) -> object:
        """Start partition `pid`'s collective (asynchronously); return a handle."""

    def test(self, handle) -> bool:
        """Non-blocking: is that collective done? (Asked only when not in_order.)"""

    def wait(self, handle) -> None:
        """Block until that collective is done and finish the partition (average it)."""

    def sent_bytes(self, pid: int, handle) -> int:
        """After wait(): the bytes that collective reduced on this rank."""

    def negotiate(self, values: Sequence[int]) -> list[int]:
        """Blocking: the elementwise minimum of `values` over all ranks."""


class Transport(Protocol):
    """How one model's ranks talk: torch.distributed groups, parameter servers or Horovod.
    Each backend module holds its transport and its policy (e.g. Horovod's credit)."""

    def agree(self, values: list[int]) -> list[int]:
        """Rank 0's values, on every rank (a collective of the training thread)."""

    def agree_later(self, values: list[int]) -> Callable[[], list[int]]:
        """agree() posted now, without waiting: calling the result waits and returns rank
        0's values (so the ranks do not wait for each other where it is posted)."""

    def backend(self, partitions, grad_of, dtypes) -> CommBackend:
        """The scheduler's backend for these partitions."""

    def credit(self, credit_bytes: int) -> int:
        """The credit this rank's scheduler keeps to."""

    row_sparse: bool  # embedding tables may go by their nonzero rows (bsrun/sched/row_sparse.py)


class SchedulerClosed(RuntimeError):
    pass


@dataclass
class _InFlight:
    round: int
    pid: int
    handle: object
    finished: bool = False


POLL_MIN_S = 0.0002  # polling an out-of-order backend: back off from 0.2 ms to 2 ms
POLL_MAX_S = 0.002
RENEGOTIATE_EVERY = 16  # rounds; the others replay the last negotiated order (matched_by_order)


class Scheduler:
    def __init__(self, backend: CommBackend, sizes: Sequence[int], credit_bytes: int,
                 on_complete: Callable[[int], None], on_error: Callable[[BaseException], None],
                 pace_s: float = 0.002, name: str = "bsrun",
                 trace: Callable[[str, int, int], None] | None = None):
        self.backend = backend
        self.trace = trace
        self.sizes = list(sizes)
        self.credit = credit_bytes
        self.on_complete = on_complete
        self.on_error = on_error
        self.pace_s = pace_s
        self._ready = [0] * len(self.sizes)   # times each partition was marked ready
        self._finished: dict[int, int] = {}   # round -> collectives finished here
        self._issued: deque[_InFlight] = deque()  # posted, oldest first; left from the front
        self._cv = threading.Condition()
        self._closing = False
        self.stats = {"rounds": 0, "partitions": 0, "bytes": 0, "negotiations": 0, "replayed_rounds": 0}
        self._threads = [threading.Thread(target=self._guard, args=(fn,), name=f"{name}-{fn.__name__}",
                                          daemon=True) for fn in (self._control, self._finisher)]
        for t in self._threads:
            t.start()

    def mark_ready(self, pid: int) -> None:
        if self.trace is not None:
            self.trace("ready", pid, time.perf_counter_ns(), self.sizes[pid])
        with self._cv:
            self._ready[pid] += 1
            self._cv.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)

    def _guard(self, fn) -> None:
        try:
            fn()
        except SchedulerClosed:
            pass
        except BaseException as e:  # reported to the training thread, which raises it
            self.on_error(e)
            self.close(timeout=0)

    def _wait(self, predicate, timeout=None) -> bool:
        """Under the lock: sleep until predicate() or closing; raise if closing."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not predicate():
            if self._closing:
                raise SchedulerClosed()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self._cv.wait(remaining)
        if self._closing:
            raise SchedulerClosed()
        return True

    # --- the finisher: hands back each collective as it finishes -------------------------

    def _finisher(self) -> None:
        while True:
            entry = self._next_finished()
            self.backend.wait(entry.handle)
            sent = self.backend.sent_bytes(entry.pid, entry.handle)
            if self.trace is not None:
                self.trace("finish", entry.pid, time.perf_counter_ns(), sent)
            self.stats["partitions"] += 1
            self.stats["bytes"] += sent
            self.on_complete(entry.pid)
            with self._cv:
                entry.finished = True
                while self._issued and self._issued[0].finished:  # counts are of a finished prefix
                    done = self._issued.popleft()
                    self._finished[done.round] = self._finished.get(done.round, 0) + 1
                    self._finished.pop(done.round - 2, None)
                self._cv.notify_all()

    def _next_finished(self) -> _InFlight:
        """The oldest collective (in order), or any finished one (out of order: polled, so
        that one stuck ahead does not hide the urgent ones finishing behind it)."""
        pause = POLL_MIN_S
        while True:
            with self._cv:
                self._wait(lambda: any(not e.finished for e in self._issued))
                pending = [e for e in self._issued if not e.finished]
            if self.backend.in_order:
                return pending[0]
            for entry in pending:
                if self.backend.test(entry.handle):
                    return entry
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)

    # --- the control thread: agree, then issue ------------------------------------------

    def _control(self) -> None:
        round_ = 0
        order: list[int] | None = None  # the last negotiated round's, while it may be replayed
        while True:
            with self._cv:
                self._wait(lambda: any(c > round_ for c in self._ready))
            if order is not None and round_ % RENEGOTIATE_EVERY:
                self._replay_round(round_, order)
                self.stats["replayed_rounds"] += 1
            else:
                issued = self._control_round(round_)
                order = issued if self.backend.matched_by_order else None
            round_ += 1
            self.stats["rounds"] = round_

    def _replay_round(self, round_: int, order: list[int]) -> None:
        """Post in `order` (every rank's), each partition once it is ready here and fits the
        credit beside this round's unfinished bytes (see the module's docstring)."""
        for k, pid in enumerate(order):
            def postable() -> bool:
                unfinished = order[self._finished.get(round_, 0):k]
                return self._ready[pid] > round_ and next_to_issue(
                    {pid}, sum(self.sizes[p] for p in unfinished), self.sizes, self.credit) is not None

            with self._cv:
                self._wait(postable)
            self._post(round_, pid)

    def _control_round(self, round_: int) -> list[int]:
        """A negotiated round; returns the order it issued in (the same on every rank)."""
        count = len(self.sizes)
        issued: list[int] = []
        issued_set: set[int] = set()
        everywhere: set[int] = set()  # ready on every rank, as of the last negotiation
        sent: list[int] | None = None
        result: list[int] | None = None
        last = 0.0

        def mine() -> list[int]:
            return [1 if c > round_ else 0 for c in self._ready] + [self._finished.get(round_, 0)]

        while len(issued) < count:
            blocked = bool(everywhere - issued_set)  # ready everywhere, held back by the credit

            def news() -> bool:
                now = mine()
                return sent is None or now[:count] != sent[:count] or (blocked and now[count] != sent[count])

            def ahead() -> bool:  # others are behind this rank: they will have news
                return result is not None and (sent[:count] != result[:count]
                                               or (blocked and sent[count] != result[count]))

            with self._cv:
                if not news():
                    if ahead():
                        self._wait(news, timeout=max(0.0, last + self.pace_s - time.monotonic()))
                    else:
                        self._wait(news)
                sent = mine()
            result = self.backend.negotiate(sent)
            last = time.monotonic()
            self.stats["negotiations"] += 1
            everywhere = {p for p in range(count) if result[p] >= 1}
            self._issue(round_, issued, issued_set, everywhere, finished_everywhere=result[count])
        return issued

    def _issue(self, round_, issued, issued_set, everywhere, finished_everywhere) -> None:
        """Issue, most urgent first, what is ready everywhere and fits in the credit."""
        while True:
            in_flight = sum(self.sizes[p] for p in issued[finished_everywhere:])
            choice = next_to_issue(everywhere - issued_set, in_flight, self.sizes, self.credit)
            if choice is None:
                return
            self._post(round_, choice)
            issued.append(choice)
            issued_set.add(choice)

    def _post(self, round_: int, pid: int) -> None:
        if self.trace is not None:
            self.trace("post", pid, time.perf_counter_ns(), self.sizes[pid])
        handle = self.backend.post(pid)
        with self._cv:
            self._issued.append(_InFlight(round_, pid, handle))
            self._cv.notify_all()
