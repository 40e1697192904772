"""The link's fit (bsrun/sched/link.py): busy periods of overlapping collectives, and a
fixed cost and bandwidth read from them that do not depend on how the collectives inside
a period overlapped: the way gloo's two workers share one connection."""

import random

import pytest

from bsrun.sched.link import busy_periods, fit


def fifo_pipe(posts, fixed_s, bandwidth):
    """(bytes, posted, finished) of collectives served back to back in posting order by
    one FIFO link, each taking fixed_s + bytes / bandwidth: how the emulated link behaves."""
    out, free = [], 0.0
    for posted, nbytes in sorted(posts):
        free = max(free, posted) + fixed_s + nbytes / bandwidth
        out.append((nbytes, posted, free))
    return out


def test_busy_periods_join_collectives_whose_times_overlap():
    events = [(10, 0.0, 2.0), (20, 1.0, 3.0), (5, 2.5, 2.9), (7, 4.0, 5.0)]
    assert busy_periods(events) == [(3, 35, 3.0), (1, 7, 1.0)]
    assert busy_periods([]) == []


def test_the_fit_recovers_the_link_from_bursts_of_overlapping_collectives():
    rng = random.Random(3)
    posts, t = [], 0.0
    for _ in range(12):  # a backward pass's burst, then compute
        t += rng.uniform(0.2, 0.5)
        posts += [(t + rng.uniform(0.0, 0.01), rng.choice([2**16, 2**20, 4 * 2**20])) for _ in range(rng.randint(1, 6))]
    fixed, per_byte = fit(fifo_pipe(posts, 2e-3, 6.25e7), fixed_if_unknown=0.0)
    assert fixed == pytest.approx(2e-3, rel=1e-6) and per_byte == pytest.approx(1 / 6.25e7, rel=1e-6)


def test_the_fit_does_not_care_how_the_collectives_of_a_period_split_its_time():
    """Two workers sharing one connection finish the first of a pair late and the second
    early, or both together: only the period's length is read, so the fit is the same."""
    serial = [(2**22, 0.0, 0.1), (2**20, 0.0, 0.125), (2**22, 1.0, 1.1), (2**21, 2.0, 2.05), (2**20, 2.0, 2.075)]
    shared = [(2**22, 0.0, 0.125), (2**20, 0.0, 0.125), (2**22, 1.0, 1.1), (2**21, 2.0, 2.075), (2**20, 2.0, 2.07)]
    assert fit(serial, 0.0) == pytest.approx(fit(shared, 0.0))


def test_one_size_of_collective_leaves_the_fixed_cost_unknown_and_still_fits_the_rate():
    events = fifo_pipe([(float(i), 2**20) for i in range(5)], 1e-3, 1.25e8)
    fixed, per_byte = fit(events, fixed_if_unknown=5e-4)
    assert fixed == 5e-4 and per_byte == pytest.approx((1e-3 + 2**20 / 1.25e8 - 5e-4) / 2**20)
    assert fit(events, fixed_if_unknown=1.0)[0] == pytest.approx((1e-3 + 2**20 / 1.25e8) / 2)  # at most half
    assert fit([], 0.0) is None and fit([(0, 0.0, 1.0)], 0.0) is None
