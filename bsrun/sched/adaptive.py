"""Online adaptation's decisions: which scheduling points to try, and which to keep.

Pure and framework-free: rank 0's `Explorer` is fed step times and the run's own
partition transfers, and answers at each window's end with the point every rank should
run next (bsrun/inject/adapt.py carries that answer to the ranks and re-lays the model).

A point is what can change between two steps without changing the result: the partition
size, the credit, the transfer order (the configured one, or fifo: as gradients become
ready) and whether the next forward waits per layer (the dependency proxy) or step()
waits for everything (as plain DDP does at the end of backward). The candidates:
- the incumbent: the configured point (or the one a previous run or `bsrun tune` left);
- the fitted point: from the run's own transfers a per-partition fixed cost `a` and a
  bandwidth `B` (a busy period of the link takes count x a + bytes / B:
  bsrun/sched/link.py); the partition that keeps `a` to a tenth of a partition's
  transfer (P = 9·a·B, a power of two between MIN_PARTITION and 64 MiB, and at most
  MAX_PARTITIONS a step), credit 2x;
- the unscheduled-like point: DDP's 25 MiB buckets, fifo order, unlimited credit, no
  per-layer wait, so that bsrun can always fall back to what plain DDP does.
Each is timed for one window (its first step, which pays the switch, is not timed); the
decision after the incumbent's window says the fitted link (a, B) in its why; the
fastest median wins, and the incumbent is left only for a point KEEP_MARGIN faster, twice:
the winner runs a second window and must beat the incumbent's median again (steps vary by
10-25% here, and one lucky window once kept a point that then ran 22-32% slower); then the
incumbent is timed once more (A/B/A). Its first window comes right after the warm-up, so a
run that still speeds up (or slows down) as it goes favoured whatever was timed later; the
incumbent's first and last windows give that trend, and the winner is kept only if its two
windows beat the incumbent as interpolated at those same windows by KEEP_MARGIN. Then,
every window, the step time is compared with the kept point's; DRIFT_WINDOWS windows in a
row off by more than DRIFT (the network or the load changed) start the search again,
re-fitted on the windows after the change.
Where the unscheduled-like point is plain DDP itself (`fallback_first`: a DDP model runs it
on DDP's own reducer), it takes the incumbent's place once timed: the others must beat
plain DDP, by the same rules, to be kept, so a run whose windows cannot tell the points
apart keeps what it costs without bsrun.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple, Sequence

from bsrun.sched import link

WINDOW = 4            # optimizer steps per decision; after a switch the first is not timed
WARMUP_STEPS = 2      # steps before the incumbent's first timed window (first-step costs)
KEEP_MARGIN = 0.02    # a point replaces the incumbent only when this much faster
DRIFT = 0.25          # a window this far from the kept point's median ...
DRIFT_WINDOWS = 3     # ... this many times in a row: search again
# A first search, to the step that keeps a point: up to six windows (the starting point,
# the fitted one, the unscheduled-like one and, when the start is a learned point, the
# configured one; then a second window for a winner that would replace the start, and the
# start once more).
SEARCH_STEPS = WARMUP_STEPS + 6 * WINDOW
DDP_BUCKET_BYTES = 25 * 2**20
UNLIMITED = 2**62
# Not below 1 MiB: what a partition costs the CPU (hooks, the comm thread's Python, on 2
# cores) is not in the link's fixed cost, which the busy periods rarely resolve (0.5 ms
# is then assumed). ResNet-50's run at 0.5 Gbit/s that kept a fitted 128 KiB, after it
# won its search window, ran 1.203 s a step against 0.910-0.985 s for the two runs that
# kept 4 MiB (BENCHMARKS.md, fifth pass).
MIN_PARTITION, MAX_PARTITION = 2**20, 64 * 2**20
MAX_PARTITIONS = 128  # a fitted point has at most this many partitions a step (a window at it stays cheap)
FALLBACK_FIXED_COST_S = 5e-4  # when the transfers cannot separate fixed cost from bandwidth


@dataclass(frozen=True)
class Point:
    partition: int       # bytes; 0: each tensor whole
    credit_bytes: int
    order: str           # the configured order's name, or "fifo"
    proxy: bool          # per-layer waits in the next forward (False: wait at step())

    def as_dict(self) -> dict:
        return asdict(self)


def describe_point(point: dict) -> str:
    """`partition 4 MiB, credit 8 MiB, order forward, per-layer waits` from a point's dict."""
    def size(n: int) -> str:
        return "unlimited" if n >= UNLIMITED else "whole tensors" if n == 0 else f"{n / 2**20:g} MiB"
    waits = "per-layer waits" if point["proxy"] else "waits at step()"
    return (f"partition {size(point['partition'])}, credit {size(point['credit_bytes'])}, "
            f"order {point['order']}, {waits}")


POINT_KNOBS = ("partition", "credit", "order")  # the knobs a point sets; a user's value of one is Fixed


@dataclass(frozen=True)
class Fixed:
    """What the user fixed (flag, file or environment): every candidate keeps it."""
    partition: int | None = None
    credit_bytes: int | None = None
    order: str | None = None

    def apply(self, point: Point) -> Point:
        return replace(point, partition=point.partition if self.partition is None else self.partition,
                       credit_bytes=point.credit_bytes if self.credit_bytes is None else self.credit_bytes,
                       order=point.order if self.order is None else self.order)


def unscheduled_like() -> Point:
    return Point(DDP_BUCKET_BYTES, UNLIMITED, "fifo", False)


def fit_link(transfers: Sequence[tuple[int, float, float]]) -> tuple[float, float] | None:
    """(fixed cost s, bandwidth B/s) from (bytes, posted s, finished s) of partitions, or None
    (bsrun/sched/link.py: over the link's busy periods)."""
    fitted = link.fit(transfers, FALLBACK_FIXED_COST_S)
    return None if fitted is None else (fitted[0], 1.0 / fitted[1])


def fitted_point(link: tuple[float, float] | None, incumbent: Point, model_bytes: int = 0) -> Point | None:
    """The point for a link of this fixed cost and bandwidth; `model_bytes`: the gradient
    bytes of one step, which bound the number of partitions."""
    if link is None:
        return None
    fixed, bandwidth = link
    target = min(max(9 * fixed * bandwidth, MIN_PARTITION, model_bytes / MAX_PARTITIONS), MAX_PARTITION)
    partition = MIN_PARTITION
    while partition * 2 <= target:
        partition *= 2
    return Point(partition, 2 * partition, incumbent.order if incumbent.order != "fifo" else "forward", True)


class Timing(NamedTuple):
    """A point's median step over one timing window; windows count from the search's first (0)."""

    window: int
    median: float


@dataclass
class Decision:
    point: Point | None      # switch to it at this boundary; None: stay
    why: str
    median_s: float | None   # the kept point's median (keep), else that of the window just ended
    trace: bool = False      # collect transfers for a fit during the next window


class Explorer:
    """Rank 0's search. `window_done(step_times, transfers)` at every window's end;
    transfers: (bytes, posted s, finished s) of the partitions, while a fit wants them."""

    def __init__(self, incumbent: Point, fixed: Fixed, others: Sequence[Point] = (), model_bytes: int = 0,
                 fallback_first: bool = False):
        """`others`: points tried in every search besides the fitted and unscheduled-like
        ones (the configured point, when a learned one is the incumbent); `model_bytes`:
        the gradient bytes of one step; `fallback_first`: the unscheduled-like point is the
        one to beat (see the module)."""
        self.fixed = fixed
        self.fallback_first = fallback_first
        self.model_bytes = model_bytes
        self.others = list(others)
        self.start_point = incumbent
        self.current = incumbent
        self.kept: Point = incumbent
        self.kept_median: float | None = None
        self.queue: list[Point] = []     # points still to try in this search
        self.confirming: Point | None = None  # the winner, on its second window
        self.retiming: tuple[Point, list[Timing]] | None = None  # the winner and its two windows
        self.timed: dict[Point, Timing] = {}  # each point's first window in this search
        self.windows = 0                      # windows ended in this search
        self.searching = True
        self.drifting = 0

    def start(self) -> Decision:
        """Before the first window: time the incumbent and gather its transfers."""
        return Decision(None, "explore: timing the starting point", None, trace=True)

    def window_done(self, step_times: Sequence[float], transfers: Sequence[tuple[int, float, float]]) -> Decision:
        median = statistics.median(step_times) if step_times else None
        if self.searching:
            return self._search(median, transfers)
        if median is None or self.kept_median is None:
            return Decision(None, "steady", median)
        off = abs(median / self.kept_median - 1) > DRIFT
        self.drifting = self.drifting + 1 if off else 0
        if self.drifting < DRIFT_WINDOWS:
            return Decision(None, "steady", median)
        self.drifting = 0
        self.searching, self.timed, self.windows = True, {}, 0
        self.queue, self.confirming, self.retiming = [], None, None
        why = f"drift: step {median:.4g} s against {self.kept_median:.4g} s when kept; "
        if self.fallback_first and self.kept == self.fixed.apply(unscheduled_like()):
            # plain DDP's transfers are not bsrun's to see: the new fit needs a point of bsrun's
            return self._switch(self.start_point, why + "searching again from the starting point, "
                                                        "whose transfers the fit needs", median, trace=True)
        return Decision(None, why + "re-timing it and searching again", median, trace=True)

    def conclude(self, why: str) -> Decision:
        """No window will end again (`why`): the kept point from here on; a search under
        way ends at its incumbent, since no challenger was confirmed."""
        searching = self.searching
        self.searching, self.queue, self.confirming, self.retiming = False, [], None, None
        what = "the incumbent, its search cut short" if searching else "the point kept"
        return self._switch(self.kept, f"keep: {what}; {why}", self.kept_median)

    def _search(self, median: float | None, transfers) -> Decision:
        window, self.windows = self.windows, self.windows + 1
        if self.retiming is not None:
            return self._after_retiming(median, window)
        if self.confirming is not None:
            return self._confirm(median, window)
        if median is not None:
            self.timed[self.current] = Timing(window, median)
        fit = ""
        if not self.queue and len(self.timed) == 1:  # the incumbent was timed: the candidates
            fitted = fit_link(transfers)
            fit = "; the link could not be fitted" if fitted is None else \
                f"; link fitted: {fitted[0] * 1e3:.3g} ms a partition, {fitted[1] / 1e6:.4g} MB/s"
            candidates = [fitted_point(fitted, self.current, self.model_bytes), unscheduled_like(), *self.others]
            for point in candidates:
                if point is not None:
                    point = self.fixed.apply(point)
                    if point not in self.timed and point not in self.queue:
                        self.queue.append(point)
        if self.queue:
            self.current = self.queue.pop(0)
            return Decision(self.current, "explore: " + self._name(self.current) + fit, median)
        decision = self._keep(median)
        decision.why += fit
        return decision

    def _name(self, point: Point) -> str:
        if point == self.fixed.apply(unscheduled_like()):
            return "the unscheduled-like point"
        if point in self.others:
            return "the configured point"
        return "the point fitted to the measured link"

    def _keep(self, median: float | None) -> Decision:
        """The fastest point; one that would replace the incumbent is first confirmed."""
        fallback = self.fixed.apply(unscheduled_like())
        if self.fallback_first and fallback in self.timed:
            self.kept = fallback  # plain DDP itself: the one to beat
        incumbent = self.kept
        medians = {point: timing.median for point, timing in self.timed.items()}
        best = min(medians, key=medians.get)
        if incumbent in medians and medians[best] > medians[incumbent] * (1 - KEEP_MARGIN):
            best = incumbent
        if best != incumbent and incumbent in medians:
            self.confirming = best
            why = (f"explore: confirming {self._name(best)} ({medians[best]:.4g} s against "
                   f"{medians[incumbent]:.4g} s) on a second window")
            return self._switch(best, why, median)
        times = ", ".join(f"{t:.4g}" for t in medians.values())
        return self._settle(best, f"keep: fastest median step {medians[best]:.4g} s of {times}", medians[best])

    def _confirm(self, median: float | None, window: int) -> Decision:
        """After the challenger's second window: if it beat the incumbent again, the
        incumbent runs once more; else the incumbent is kept."""
        challenger, incumbent, self.confirming = self.confirming, self.kept, None
        before = self.timed[incumbent].median
        if median is not None and median <= before * (1 - KEEP_MARGIN):
            self.retiming = (challenger, [self.timed[challenger], Timing(window, median)])
            return self._switch(incumbent, f"explore: re-timing the incumbent ({self._name(challenger)} took "
                                           f"{median:.4g} s on its second window against {before:.4g} s)", median)
        second = "untimed" if median is None else f"{median:.4g} s"
        return self._settle(incumbent, f"keep: the incumbent; {self._name(challenger)} took {second} on its "
                                       f"second window against {before:.4g} s", before)

    def _after_retiming(self, median: float | None, window: int) -> Decision:
        """The winner is kept if its two windows beat, by KEEP_MARGIN, the incumbent
        interpolated at those windows between its first and its last."""
        (challenger, theirs), incumbent, self.retiming = self.retiming, self.kept, None
        first_at, first = self.timed[incumbent]
        trend = 0.0 if median is None else (median - first) / (window - first_at)
        expected = statistics.fmean(first + trend * (at - first_at) for at, _ in theirs)
        ours = statistics.fmean(t for _, t in theirs)
        timed = f"{first:.4g} s" + ("" if median is None else f" then {median:.4g} s")
        if ours <= expected * (1 - KEEP_MARGIN):
            return self._settle(challenger, f"keep: {self._name(challenger)}, confirmed: {ours:.4g} s against "
                                            f"{expected:.4g} s for the incumbent at its windows (timed {timed})",
                                ours)
        return self._settle(incumbent, f"keep: the incumbent; timed again ({timed}) it would take {expected:.4g} s "
                                       f"at the windows where {self._name(challenger)} took {ours:.4g} s",
                            first if median is None else median)

    def _switch(self, point: Point, why: str, median: float | None, trace: bool = False) -> Decision:
        """Run `point` next (no switch when it runs already)."""
        if point == self.current:
            return Decision(None, why, median, trace)
        self.current = point
        return Decision(point, why, median, trace)

    def _settle(self, point: Point, why: str, median: float) -> Decision:
        self.searching, self.kept, self.kept_median = False, point, median
        return self._switch(point, why, median)
