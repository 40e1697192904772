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
that then ran 22-32% slower. So the fastest other point, if its window beat the
incumbent's, duels it: the two run windows in turn, and each of the challenger's windows
is compared with the incumbent as interpolated between its windows before and after (the
run may still speed up or slow down as it goes: a point timed later would gain by that
alone). After each of the incumbent's windows, the mean paired gain and its one-sided
95% margin (CONFIDENCE_Z standard errors; a pair's spread as measured, and at least what
the steps' own spread inside the windows gives): the challenger is kept when it is
KEEP_MARGIN faster beyond the margin over MIN_PAIRS pairs or more; the incumbent when
the challenger is not KEEP_MARGIN faster within it, or when the duels' DUEL_WINDOWS
windows have not told (a point is left only for one shown faster). The fastest sweep
window may be luck: the next point whose window beat the incumbent's then duels the
winner with the windows left, if its window also beat the winner's mean, on new windows
only (the winner's lucky window would otherwise judge it). Then, every window, the step time is
compared with the kept point's; DRIFT_WINDOWS windows in a row off by more than DRIFT
(the network or the load changed) start the search again, re-fitted on the windows after
the change.
Where the unscheduled-like point is plain DDP itself (`fallback_first`: a DDP model runs it
on DDP's own reducer), it takes the incumbent's place once timed: the others must beat
plain DDP, by the same rules, to be kept, so a run whose windows cannot tell the points
apart keeps what it costs without bsrun.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple, Sequence

from bsrun.sched import link

WINDOW = 4            # optimizer steps per decision; after a switch the first is not timed
WARMUP_STEPS = 2      # steps before the incumbent's first timed window (first-step costs)
KEEP_MARGIN = 0.02    # a point replaces the incumbent only when this much faster ...
CONFIDENCE_Z = 1.645  # ... at this one-sided confidence (95%) over its paired windows,
MIN_PAIRS = 2         # ... and over at least this many of them (one is the sweep's)
DUEL_WINDOWS = 10     # windows the duels may take after the sweep (challenger and incumbent in turn)
DRIFT = 0.25          # a window this far from the kept point's median ...
DRIFT_WINDOWS = 3     # ... this many times in a row: search again
# A first search, to the step that keeps a point: up to fourteen windows (the starting point,
# the fitted one, the unscheduled-like one and, when the start is a learned point, the
# configured one; then the duel).
SEARCH_STEPS = WARMUP_STEPS + (4 + DUEL_WINDOWS) * WINDOW
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
    noise: float  # the relative spread of one step inside the window (`step_noise`)


def step_noise(step_times: Sequence[float]) -> float:
    """One step's relative spread in a window (standard deviation / mean); a duel takes
    the median over its windows, which one window with a long step cannot move."""
    if len(step_times) < 2:
        return 0.0
    return statistics.stdev(step_times) / statistics.fmean(step_times)


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
        self.challenger: Point | None = None  # in the duel with the incumbent
        self.defender: Point | None = None    # the incumbent when the sweep ended
        self.rivals: list[Point] = []         # points that may duel the incumbent next, fastest first
        self.pairs_from = 0                   # the challenger's windows from this one are paired
        self.verdicts: list[str] = []         # what this search's duels found, for the keep's why
        self.windows = 0                      # windows ended in this search
        self.duel_windows = 0                 # of them, in duels

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
        self.searching, self.queue, self.challenger = False, [], None
        what = "the incumbent, its search cut short" if searching else "the point kept"
        return self._switch(self.kept, f"keep: {what}; {why}", self.kept_median)

    def _search(self, median: float | None, noise: float, transfers) -> Decision:
        window, self.windows = self.windows, self.windows + 1
        if median is not None:
            self.timings.setdefault(self.current, []).append(Timing(window, median, noise))
        if self.challenger is not None:
            return self._duel(median)
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
        """Every candidate timed once: the incumbent is kept unless other points beat it,
        which then duel it in turn, the fastest first (see `_next_duel`)."""
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
        beat = [p for p in firsts if p != incumbent and self._paired_gains(p, incumbent)[0] < 0]
        self.rivals = sorted(beat, key=firsts.get)
        return self._next_duel(median)

    def _next_duel(self, median: float | None) -> Decision:
        """The next point whose sweep window beat the sweep's incumbent duels the incumbent
        (the winner of the duels so far) while the duel windows last: the point with the
        fastest sweep window is not always the best, and a second one gets the windows the
        first duel left. Else the incumbent is kept, with every duel's verdict as the why."""
        incumbent = self.kept
        while self.rivals and self.duel_windows + 2 <= DUEL_WINDOWS:
            rival = self.rivals.pop(0)  # never the incumbent: a challenger leaves the list to duel
            # against a point kept in a duel, which lucky windows may have won, a rival must
            # have beaten its mean, and only new windows are paired
            self.pairs_from = 0 if incumbent == self.defender else self.windows
            if self.pairs_from and self.timings[rival][0].median >= self.kept_median:
                continue
            if not self.pairs_from:
                verdict, measured = self._verdict(rival, incumbent)
                if verdict == "incumbent":
                    self.verdicts.append(measured)
                    continue
            self.challenger = rival  # its next window without a switch, if it ran last
            return self._switch(rival, f"explore: {self._name(rival)} against {self._name(incumbent)}, "
                                       f"windows in turn ({self.timings[rival][0].median:.4g} s against "
                                       f"{self.kept_median:.4g} s)", median)
        if not self.verdicts:
            self.verdicts.append(f"{self._name(incumbent)}, no other point's window beat it ({self._sweep_times()} s)")
        elif incumbent == self.defender:
            self.verdicts.insert(0, "the incumbent")
        return self._settle(incumbent, "keep: " + "; ".join(self.verdicts), self.kept_median)

    def _sweep_times(self) -> str:
        """Every timed point's sweep window, in the order they ran (for a keep's why)."""
        return ", ".join(f"{timings[0].median:.4g}" for timings in self.timings.values())

    def _duel(self, median: float | None) -> Decision:
        """Challenger and incumbent in turn; after each of the incumbent's windows, the
        verdict on the challenger's paired gains (see the module)."""
        challenger, incumbent = self.challenger, self.kept
        self.duel_windows += 1
        if self.current == challenger:
            return self._switch(incumbent, f"explore: re-timing the incumbent ({self._name(incumbent)}) to "
                                           f"pair with {self._name(challenger)}'s window", median)
        verdict, measured = self._verdict(challenger, incumbent)
        if verdict is None and self.duel_windows + 2 <= DUEL_WINDOWS:
            return self._switch(challenger, f"explore: {measured} so far; another window of it", median)
        if verdict == "challenger":
            self.kept = challenger
            self.kept_median = statistics.fmean(t.median for t in self.timings[challenger])
            outcome = f"{measured}, confirmed"
        else:
            self.kept_median = self.timings[incumbent][-1].median
            outcome = measured if verdict else f"{measured}: not shown {KEEP_MARGIN:.0%} faster within the search"
        self.challenger = None
        self.verdicts.append(outcome)
        return self._next_duel(median)

    def _verdict(self, challenger: Point, incumbent: Point) -> tuple[str | None, str]:
        """("challenger" | "incumbent" | None: not yet told, the gain as measured)."""
        gains = self._paired_gains(challenger, incumbent)
        mean = statistics.fmean(gains)
        margin = CONFIDENCE_Z * self._spread(gains, challenger, incumbent) / math.sqrt(len(gains))
        measured = (f"{self._name(challenger)} {abs(mean):.1%} {'faster' if mean < 0 else 'slower'} "
                    f"(\u00b1{margin:.1%}) than {self._name(incumbent)} over {len(gains)} paired windows")
        if len(gains) >= MIN_PAIRS and mean + margin < -KEEP_MARGIN:
            return "challenger", measured
        if mean - margin > -KEEP_MARGIN:
            return "incumbent", f"{measured}: not {KEEP_MARGIN:.0%} faster"
        return None, measured

    def _paired_gains(self, challenger: Point, incumbent: Point) -> list[float]:
        """Each of the challenger's windows against the incumbent at that window (as
        interpolated between its nearest windows before and after, which takes out a
        trend of the run; the nearest alone at either end): step / incumbent's - 1."""
        theirs = self.timings[incumbent]
        gains = []
        for at, median, _ in (t for t in self.timings[challenger] if t.window >= self.pairs_from):
            before = [t for t in theirs if t.window < at]
            after = [t for t in theirs if t.window > at]
            if before and after:
                a, b = before[-1], after[0]
                expected = a.median + (b.median - a.median) * (at - a.window) / (b.window - a.window)
            else:
                expected = (before[-1] if before else after[0]).median
            gains.append(median / expected - 1)
        return gains

    def _spread(self, gains: list[float], challenger: Point, incumbent: Point) -> float:
        """A paired gain's standard deviation: measured over the pairs, and at least what
        the steps' own spread inside the two points' windows gives a difference of two
        windows' medians (few pairs can agree by chance; a median of three normal steps
        varies 1.16 times as much as their mean)."""
        noise = statistics.median(t.noise for t in self.timings[challenger] + self.timings[incumbent])
        floor = 1.16 * noise * math.sqrt(2 / (WINDOW - 1))
        return max(statistics.stdev(gains) if len(gains) > 1 else 0.0, floor)

    def _switch(self, point: Point, why: str, median: float | None, trace: bool = False) -> Decision:
        """Run `point` next (no switch when it runs already)."""
        if point == self.current:
            return Decision(None, why, median, trace)
        self.current = point
        return Decision(point, why, median, trace)

    def _settle(self, point: Point, why: str, median: float | None) -> Decision:
        self.searching, self.kept, self.kept_median, self.challenger = False, point, median, None
        return self._switch(point, why, median)
