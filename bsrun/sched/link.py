"""The link as collectives use it: up to a few at once, sharing its bandwidth.

gloo runs a process group's collectives on a pool of worker threads (GLOO_WORKERS, its
default), taking them in posting order, so two all-reduces posted together really run at
once and each takes about twice as long as alone; Horovod runs one at a time. A fit that
timed each collective from "posted, or the previous one finished" charged the first of
two concurrent ones with both, and the alpha-beta fits of adaptation and the what-if
swung with it. Both directions live here, so that they stay each other's inverse:

- `service_times`: measured (bytes, posted, finished) -> each collective's demand on the
  link, its share of the time the link worked while it ran (a running collective gets
  1/k of every moment k collectives run);
- `SharedLink`: demands -> finish times, the same model replayed: up to `channels`
  running in posting order, the others queued, the running ones sharing equally.

A collective's demand is alpha + beta * bytes link-seconds, the per-collective cost
included: the fits read it from the shares, and the replay charges it the same way.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Hashable, Sequence

GLOO_WORKERS = 2  # torch's ProcessGroupGloo default (`ProcessGroupGloo._Options()._threads`)


def starts(events: Sequence[tuple[int, float, float]], channels: int) -> list[float]:
    """When each collective (bytes, posted, finished; in posting order) began to run: in
    posting order, once fewer than `channels` of the earlier ones were still running."""
    out: list[float] = []
    latest: list[float] = []  # the `channels` latest finishes so far, a min-heap
    for _, posted, finished in events:
        begin = max(posted, out[-1]) if out else posted
        if len(latest) == channels:
            begin = max(begin, latest[0])
        out.append(begin)
        heapq.heappush(latest, finished)
        if len(latest) > channels:
            heapq.heappop(latest)
    return out


def service_times(events: Sequence[tuple[int, float, float]], channels: int = 1) -> list[tuple[int, float]]:
    """(bytes, post s, finish s) of one channel pool's collectives -> (bytes, service s) in
    posting order: each collective's share of the time the link worked while it ran."""
    ordered = sorted(events, key=lambda e: e[1])
    begun = starts(ordered, channels)
    edges = sorted([(t, 1, i) for i, t in enumerate(begun)] + [(f, 0, i) for i, (_, _, f) in enumerate(ordered)])
    shares = [0.0] * len(ordered)
    running: set[int] = set()
    previous = edges[0][0] if edges else 0.0
    for t, is_start, i in edges:  # at equal times finishes (0) come before starts (1)
        for j in running:
            shares[j] += (t - previous) / len(running)
        previous = t
        if is_start:
            running.add(i)
        else:
            running.discard(i)
    return [(nbytes, share) for (nbytes, _, _), share in zip(ordered, shares)]


class SharedLink:
    """A replayed link: `post` collectives with their demand (s), `advance` the clock to
    collect those that finished. Up to `channels` run at once, in posting order, sharing
    the link equally; none starts before `free_at`."""

    def __init__(self, channels: int, free_at: float = 0.0):
        self.channels = channels
        self.now = free_at
        self.running: dict[Hashable, float] = {}  # key -> demand left (s of the whole link)
        self.queue: deque[tuple[Hashable, float]] = deque()

    def post(self, key: Hashable, at: float, demand: float) -> list[tuple[Hashable, float]]:
        """Post at `at` (no earlier than the clock); returns what finished before it."""
        done = self.advance(at)
        self.queue.append((key, max(demand, 0.0)))
        self._fill()
        return done

    def next_finish(self) -> float | None:
        """When the next running collective finishes, if nothing more is posted."""
        if not self.running:
            return None
        return self.now + min(self.running.values()) * len(self.running)

    def advance(self, until: float) -> list[tuple[Hashable, float]]:
        """Run the link to `until`: (key, finish time) of each collective done by then."""
        done: list[tuple[Hashable, float]] = []
        while (nxt := self.next_finish()) is not None and nxt <= until:
            step = min(self.running.values())
            for key in list(self.running):
                self.running[key] -= step
                if self.running[key] <= 1e-12:
                    del self.running[key]
                    done.append((key, nxt))
            self.now = nxt
            self._fill()
        if self.running and until > self.now:
            share = (until - self.now) / len(self.running)
            self.running = {k: left - share for k, left in self.running.items()}
        self.now = max(self.now, until)
        return done

    def drain(self) -> list[tuple[Hashable, float]]:
        """Run until everything posted has finished."""
        done = []
        while (nxt := self.next_finish()) is not None:
            done += self.advance(nxt)
        return done

    def _fill(self) -> None:
        while self.queue and len(self.running) < self.channels:
            key, demand = self.queue.popleft()
            self.running[key] = demand
