"""Whether one scheduling point is faster than another, from their timing windows in turn.

Pure statistics for adaptation's race (bsrun/sched/adaptive.py): each of the challenger's
windows is paired with the incumbent as interpolated between the incumbent's windows
before and after it (the run may still speed up or slow down as it goes: a point timed
later would gain by that alone), and the mean paired gain is judged with a one-sided
95% margin (CONFIDENCE_Z standard errors; a pair's spread as measured, and at least what
the steps' own spread inside the windows gives, since few pairs can agree by chance).
"""

from __future__ import annotations

import math
import statistics
from typing import NamedTuple, Sequence

KEEP_MARGIN = 0.02    # a point replaces the incumbent only when this much faster ...
CONFIDENCE_Z = 1.645  # ... at this one-sided confidence (95%) over its paired windows,
MIN_PAIRS = 2         # ... and over at least this many of them (one is the sweep's)


class Timing(NamedTuple):
    """A point's median step over one timing window; windows count from the search's first (0)."""

    window: int
    median: float
    noise: float  # the relative spread of one step inside the window (`step_noise`)


def step_noise(step_times: Sequence[float]) -> float:
    """One step's relative spread in a window (standard deviation / mean); a race takes
    the median over its windows, which one window with a long step cannot move."""
    if len(step_times) < 2:
        return 0.0
    return statistics.stdev(step_times) / statistics.fmean(step_times)


def paired_gains(challenger: Sequence[Timing], incumbent: Sequence[Timing], pairs_from: int = 0) -> list[float]:
    """Each of the challenger's windows from window `pairs_from` against the incumbent at
    that window (interpolated between its nearest windows before and after; the nearest
    alone at either end): step / incumbent's - 1."""
    gains = []
    for at, median, _ in (t for t in challenger if t.window >= pairs_from):
        before = [t for t in incumbent if t.window < at]
        after = [t for t in incumbent if t.window > at]
        if before and after:
            a, b = before[-1], after[0]
            expected = a.median + (b.median - a.median) * (at - a.window) / (b.window - a.window)
        else:
            expected = (before[-1] if before else after[0]).median
        gains.append(median / expected - 1)
    return gains


class Comparison(NamedTuple):
    """The challenger's mean paired gain (negative: faster), its one-sided margin, the pairs."""

    mean: float
    margin: float
    pairs: int

    @property
    def verdict(self) -> str | None:
        """"challenger" (KEEP_MARGIN faster beyond the margin, over MIN_PAIRS or more),
        "incumbent" (not KEEP_MARGIN faster within it), or None: not yet told."""
        if self.pairs >= MIN_PAIRS and self.mean + self.margin < -KEEP_MARGIN:
            return "challenger"
        if self.mean - self.margin > -KEEP_MARGIN:
            return "incumbent"
        return None


def compare(challenger: Sequence[Timing], incumbent: Sequence[Timing], pairs_from: int,
            timed_steps: int) -> Comparison | None:
    """The challenger's windows (from `pairs_from`) against the incumbent's; None without a
    pair. `timed_steps`: the steps a window's median is taken over, for the margin's floor
    (a median of three normal steps varies 1.16 times as much as their mean)."""
    gains = paired_gains(challenger, incumbent, pairs_from)
    if not gains:
        return None
    noise = statistics.median(t.noise for t in [*challenger, *incumbent])
    floor = 1.16 * noise * math.sqrt(2 / timed_steps)
    spread = max(statistics.stdev(gains) if len(gains) > 1 else 0.0, floor)
    return Comparison(statistics.fmean(gains), CONFIDENCE_Z * spread / math.sqrt(len(gains)), len(gains))
