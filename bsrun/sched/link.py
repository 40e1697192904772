"""The link's fit: a fixed cost per collective and a bandwidth, from collectives as they ran.

gloo runs a group's collectives on two worker threads, but both send through the same
connection to each peer, so two all-reduces in flight interleave their messages in one
FIFO stream: the link is one pipe, busy without a pause from the first post of a run of
overlapping collectives to the last finish. Timing each collective alone (from its post,
or the previous finish) charges the first of two overlapping ones with both, and a small
one queued behind a large one with the large one's bytes; the fits of adaptation and of
the what-if swung with it (alpha 3.7-17.7 ms, 0.50-0.77 Gbit/s on one job at 0.5 Gbit/s).
Here the unit is the busy period instead: its length is count x fixed cost + bytes /
bandwidth whatever the overlap inside it, and the periods of a run differ enough in
count and bytes to tell the two apart. The replay of the same model is the what-if's
one link that serves collectives back to back in issue order (bsrun/profile/whatif.py).
"""

from __future__ import annotations

from typing import Sequence

# n and bytes per period this close to proportional (one size of collective) cannot
# separate a fixed cost from the bandwidth: 1 - cos^2 of the angle between them.
COLLINEAR = 0.01


def busy_periods(events: Sequence[tuple[int, float, float]]) -> list[tuple[int, int, float]]:
    """(bytes, posted s, finished s) of collectives -> (count, bytes, seconds) of each
    maximal run of them whose [posted, finished] overlap: the link busy without a pause."""
    periods: list[list] = []  # [count, bytes, start, end]
    for nbytes, posted, finished in sorted(events, key=lambda e: e[1]):
        if periods and posted < periods[-1][3]:
            period = periods[-1]
            period[0] += 1
            period[1] += nbytes
            period[3] = max(period[3], finished)
        else:
            periods.append([1, nbytes, posted, finished])
    return [(count, nbytes, end - start) for count, nbytes, start, end in periods]


def fit(events: Sequence[tuple[int, float, float]], fixed_if_unknown: float) -> tuple[float, float] | None:
    """(fixed cost s a collective, seconds a byte) by least squares over the busy periods
    (seconds = count * fixed + bytes * per_byte, both >= 0), or None without a period
    that took time. Where the periods cannot separate the two (fewer than three, one size
    of collective, or a negative fixed cost), the fixed cost is taken as `fixed_if_unknown`
    (at most half the shortest period's time a collective) and the bandwidth fitted."""
    periods = [(n, b, t) for n, b, t in busy_periods(events) if b > 0 and t > 0]
    if not periods:
        return None
    snn = sum(n * n for n, _, _ in periods)
    sbb = sum(b * b for _, b, _ in periods)
    snb = sum(n * b for n, b, _ in periods)
    snt = sum(n * t for n, _, t in periods)
    sbt = sum(b * t for _, b, t in periods)
    det = snn * sbb - snb * snb
    if len(periods) >= 3 and det > COLLINEAR * snn * sbb:
        fixed, per_byte = (sbb * snt - snb * sbt) / det, (snn * sbt - snb * snt) / det
        if fixed >= 0 and per_byte > 0:
            return fixed, per_byte
    fixed = min(fixed_if_unknown, min(t / n for n, _, t in periods) / 2)
    per_byte = (sbt - fixed * snb) / sbb
    return (fixed, per_byte) if per_byte > 0 else None
