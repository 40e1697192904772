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
decision after the incumbent's window says the fitted link (a, B) in its why. Steps vary
by 10-25% here, and a window's median by 4-10% (BENCHMARKS.md, fourteenth pass): a gain
of a few percent does not show in one window, and one lucky window once kept a point
that then ran 22-32% slower. So the points whose window beat the incumbent's, or came
within KEEP_MARGIN of it (one window may hide a real gain), race it (a duel, where one
does): each runs a window in turn, then the incumbent, round after round. After each of
the incumbent's windows, each racing point's windows are paired with the incumbent's
(bsrun/sched/paired.py: against the run's own trend, with a one-sided 95% margin): a
point leaves the race when it is not KEEP_MARGIN faster within the margin; it wins when
it is KEEP_MARGIN faster beyond the margin over MIN_PAIRS pairs or more (of several, the
one with the best mean); the incumbent stays when no point is left or the race's windows
have not told (a point is left only for one shown faster). The race has RACE_WINDOWS
windows, and up to MAX_RACE_WINDOWS while a racing point measures KEEP_MARGIN faster but
is not yet confirmed (the windows are then spent where a gain shows); where a round of
all no longer fits, the points measured fastest so far run it. All at once, not the
fastest sweep window's point first: that window may be luck, and a duel with it once
spent every window while the point that was 10% faster waited (ResNet-50 at 3 Gbit/s,
BENCHMARKS.md, sixteenth pass; scripts/simulate_search.py compares the rules). A winner
becomes the incumbent; the points that measured faster than it race it with the windows
left, on new windows only (their windows so far were paired with the old incumbent's).
Then, every window, the step time is compared with the kept point's; DRIFT_WINDOWS
windows in a row off by more than DRIFT (the network or the load changed) start the
search again, re-fitted on the windows after the change.
Where the unscheduled-like point is plain DDP itself (`fallback_first`: a DDP model runs it
on DDP's own reducer), it takes the incumbent's place once timed: the others must beat
plain DDP, by the same rules, to be kept, so a run whose windows cannot tell the points
apart keeps what it costs without bsrun.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, replace
from typing import Callable, Sequence

from bsrun.sched import link
from bsrun.sched.paired import KEEP_MARGIN, Comparison, Timing, compare, step_noise

WINDOW = 4            # optimizer steps per decision; after a switch the first is not timed
WARMUP_STEPS = 2      # steps before the incumbent's first timed window (first-step costs)
RACE_WINDOWS = 10     # windows the race may take after the sweep (the racing points and the incumbent in turn),
MAX_RACE_WINDOWS = 20  # ... and up to this many while a racing point measures KEEP_MARGIN faster, unconfirmed
DRIFT = 0.25          # a window this far from the kept point's median ...
DRIFT_WINDOWS = 3     # ... this many times in a row: search again
# A first search, to the step that keeps a point: up to twenty-four windows (the starting
# point, the fitted one, the unscheduled-like one and, when the start is a learned point,
# the configured one; then the race).
SEARCH_STEPS = WARMUP_STEPS + (4 + MAX_RACE_WINDOWS) * WINDOW
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
        self.drifting = 0
        self._new_search()

    def _new_search(self) -> None:
        self.searching = True
        self.queue: list[Point] = []     # points still to try in this search
        self.timings: dict[Point, list[Timing]] = {}  # each point's windows in this search, in order
        self.racing: list[Point] = []         # points racing the incumbent, in their turn's order
        self.defender: Point | None = None    # the incumbent when the sweep ended
        self.pairs_from = 0                   # the racing points' windows from this one are paired
        self.verdicts: list[str] = []         # what this search's races found, for the keep's why
        self.windows = 0                      # windows ended in this search
        self.race_windows = 0                 # of them, in races

    def start(self) -> Decision:
        """Before the first window: time the incumbent and gather its transfers."""
        return Decision(None, "explore: timing the starting point", None, trace=True)

    def window_done(self, step_times: Sequence[float], transfers: Sequence[tuple[int, float, float]]) -> Decision:
        median = statistics.median(step_times) if step_times else None
        if self.searching:
            return self._search(median, step_noise(step_times), transfers)
        if median is None or self.kept_median is None:
            return Decision(None, "steady", median)
        off = abs(median / self.kept_median - 1) > DRIFT
        self.drifting = self.drifting + 1 if off else 0
        if self.drifting < DRIFT_WINDOWS:
            return Decision(None, "steady", median)
        self.drifting = 0
        self._new_search()
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
        self.searching, self.queue, self.racing = False, [], []
        what = "the incumbent, its search cut short" if searching else "the point kept"
        return self._switch(self.kept, f"keep: {what}; {why}", self.kept_median)

    def _search(self, median: float | None, noise: float, transfers) -> Decision:
        window, self.windows = self.windows, self.windows + 1
        if median is not None:
            self.timings.setdefault(self.current, []).append(Timing(window, median, noise))
        if self.racing:
            return self._race_window(median)
        fit = ""
        if not self.queue and len(self.timings) == 1:  # the incumbent was timed: the candidates
            fitted = fit_link(transfers)
            fit = "; the link could not be fitted" if fitted is None else \
                f"; link fitted: {fitted[0] * 1e3:.3g} ms a partition, {fitted[1] / 1e6:.4g} MB/s"
            candidates = [fitted_point(fitted, self.current, self.model_bytes), unscheduled_like(), *self.others]
            for point in candidates:
                if point is not None:
                    point = self.fixed.apply(point)
                    if point not in self.timings and point not in self.queue:
                        self.queue.append(point)
        if self.queue:
            self.current = self.queue.pop(0)
            return Decision(self.current, "explore: " + self._name(self.current) + fit, median)
        decision = self._after_sweep(median)
        decision.why += fit
        return decision

    def _name(self, point: Point) -> str:
        if point == self.fixed.apply(unscheduled_like()):
            return "the unscheduled-like point"
        if point in self.others:
            return "the configured point"
        if point == self.start_point:
            return "the starting point"
        return "the point fitted to the measured link"

    def _after_sweep(self, median: float | None) -> Decision:
        """Every candidate timed once: the incumbent is kept unless other points come within
        KEEP_MARGIN of it or beat it (one window may hide a real gain), which then race it
        (see `_next_round`)."""
        fallback = self.fixed.apply(unscheduled_like())
        if self.fallback_first and fallback in self.timings:
            self.kept = fallback  # plain DDP itself: the one to beat
        incumbent = self.kept
        firsts = {point: timings[0].median for point, timings in self.timings.items()}
        if incumbent not in firsts:  # its window was not timed: the fastest of those that were
            if not firsts:
                return self._settle(incumbent, "keep: the incumbent; no window was timed", median)
            best = min(firsts, key=firsts.get)
            return self._settle(best, f"keep: fastest median step {firsts[best]:.4g} s of {self._sweep_times()}", firsts[best])
        self.kept_median, self.defender = firsts[incumbent], incumbent
        near = [p for p in firsts if p != incumbent and self._compare(p, incumbent).mean < KEEP_MARGIN]
        for point in sorted(near, key=firsts.get):
            verdict, measured = self._verdict(point, incumbent)
            if verdict == "incumbent":
                self.verdicts.append(measured)
            else:
                self.racing.append(point)
        return self._next_round(median, lambda racing: (
            f"explore: {self._names(racing)} against {self._name(incumbent)}, windows in turn "
            f"({self._times(racing)} s against {self.kept_median:.4g} s)"))

    def _next_round(self, median: float | None, why: Callable[[list[Point]], str]) -> Decision:
        """The race's next round: a window of each racing point, then one of the
        incumbent's, while the race's windows last (RACE_WINDOWS, MAX_RACE_WINDOWS while one
        measures KEEP_MARGIN faster; where a round of all does not fit, the points
        measured fastest so far run it). Else the incumbent is kept, with every verdict as
        the why; `why`: the round's, of the points that run it."""
        promising = any(-math.inf < self._mean_gain(point) < -KEEP_MARGIN for point in self.racing)
        room = (MAX_RACE_WINDOWS if promising else RACE_WINDOWS) - self.race_windows - 1
        self.racing.sort(key=self._mean_gain)
        for point in self.racing[max(room, 0):]:
            self.verdicts.append(self._unconfirmed(point))
        del self.racing[max(room, 0):]
        if not self.racing:
            return self._keep_incumbent()
        if self.current in self.racing:  # it ran last: its next window without a switch
            self.racing.remove(self.current)
            self.racing.insert(0, self.current)
        return self._switch(self.racing[0], why(self.racing), median)

    def _race_window(self, median: float | None) -> Decision:
        """A window of the race ended: the next racing point's, the incumbent's, or, after
        the incumbent's, the verdicts (see the module)."""
        self.race_windows += 1
        incumbent = self.kept
        if self.current != incumbent:
            later = self.racing[self.racing.index(self.current) + 1:]
            if later:
                return self._switch(later[0], f"explore: {self._name(later[0])}'s window in the race", median)
            return self._switch(incumbent, f"explore: re-timing the incumbent ({self._name(incumbent)}) to "
                                           f"pair with the race's windows", median)
        self.kept_median = self.timings[incumbent][-1].median
        undecided, confirmed = [], []
        for point in self.racing:
            verdict, measured = self._verdict(point, incumbent)
            if verdict == "incumbent":
                self.verdicts.append(measured)
            else:
                (confirmed if verdict == "challenger" else undecided).append((point, measured))
        if not confirmed:
            self.racing = [point for point, _ in undecided]
            return self._next_round(median, lambda racing: "explore: " + "; ".join(
                m for p, m in undecided if p in racing) + " so far; another round")
        winner, measured = min(confirmed, key=lambda c: self._mean_gain(c[0]))
        self.verdicts.append(f"{measured}, confirmed")
        # the others measured faster than the winner race it on new windows only (their
        # windows so far were paired with the old incumbent's)
        best = self._mean_gain(winner)
        self.racing = []
        for point, measured in undecided + confirmed:
            if point != winner and self._mean_gain(point) < best:
                self.racing.append(point)
            elif point != winner:
                self.verdicts.append(f"{measured}: less than {self._name(winner)}")
        self.kept = winner
        self.kept_median = statistics.fmean(t.median for t in self.timings[winner])
        self.pairs_from = self.windows
        if not self.racing:
            return self._keep_incumbent()
        return self._next_round(median, lambda racing: (
            f"explore: {self._names(racing)} against {self._name(winner)} (confirmed faster than "
            f"{self._name(incumbent)}), windows in turn"))

    def _keep_incumbent(self) -> Decision:
        if not self.verdicts:
            self.verdicts.append(f"{self._name(self.kept)}, no other point's window came within "
                                 f"{KEEP_MARGIN:.0%} of it ({self._sweep_times()} s)")
        elif self.kept == self.defender:
            self.verdicts.insert(0, "the incumbent")
        return self._settle(self.kept, "keep: " + "; ".join(self.verdicts), self.kept_median)

    def _unconfirmed(self, point: Point) -> str:
        """The verdict on a racing point the race's windows left undecided."""
        return f"{self._verdict(point, self.kept)[1]}: not shown {KEEP_MARGIN:.0%} faster within the search"

    def _mean_gain(self, point: Point) -> float:
        """The point's mean paired gain against the incumbent (-inf before its first pair:
        a point that measured faster than a winner races it first)."""
        comparison = self._compare(point, self.kept)
        return -math.inf if comparison is None else comparison.mean

    def _names(self, points: Sequence[Point]) -> str:
        names = [self._name(p) for p in points]
        return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]

    def _times(self, points: Sequence[Point]) -> str:
        return ", ".join(f"{self.timings[p][0].median:.4g}" for p in points)

    def _compare(self, challenger: Point, incumbent: Point) -> Comparison | None:
        return compare(self.timings[challenger], self.timings[incumbent], self.pairs_from, WINDOW - 1)

    def _verdict(self, challenger: Point, incumbent: Point) -> tuple[str | None, str]:
        """("challenger" | "incumbent" | None: not yet told, the gain as measured;
        bsrun/sched/paired.py)."""
        c = self._compare(challenger, incumbent)
        if c is None:  # none of its windows since pairs_from had a timed step
            return None, f"{self._name(challenger)} not yet paired with {self._name(incumbent)}"
        measured = (f"{self._name(challenger)} {abs(c.mean):.1%} {'faster' if c.mean < 0 else 'slower'} "
                    f"(\u00b1{c.margin:.1%}) than {self._name(incumbent)} over {c.pairs} paired windows")
        return c.verdict, f"{measured}: not {KEEP_MARGIN:.0%} faster" if c.verdict == "incumbent" else measured

    def _sweep_times(self) -> str:
        """Every timed point's sweep window, in the order they ran (for a keep's why)."""
        return ", ".join(f"{timings[0].median:.4g}" for timings in self.timings.values())

    def _switch(self, point: Point, why: str, median: float | None, trace: bool = False) -> Decision:
        """Run `point` next (no switch when it runs already)."""
        if point == self.current:
            return Decision(None, why, median, trace)
        self.current = point
        return Decision(point, why, median, trace)

    def _settle(self, point: Point, why: str, median: float | None) -> Decision:
        self.searching, self.kept, self.kept_median, self.racing = False, point, median, []
        return self._switch(point, why, median)
