"""The link model (bsrun/sched/link.py): service shares from measured collectives, the
shared-link replay, and that the two are each other's inverse, so that the fits of
adaptation and of the what-if read back the cost per collective and the bandwidth that
the collectives really had when gloo ran two at once."""

import random

import pytest

from bsrun.sched.link import GLOO_WORKERS, SharedLink, service_times, starts


def test_gloo_workers_is_torchs_default_thread_count():
    dist = pytest.importorskip("torch.distributed")
    assert GLOO_WORKERS == dist.ProcessGroupGloo._Options()._threads


def test_one_channel_counts_each_from_its_post_or_the_previous_finish():
    assert service_times([(10, 0.0, 1.0), (20, 0.5, 3.0), (30, 5.0, 6.0)]) == [(10, 1.0), (20, 2.0), (30, 1.0)]


def test_two_collectives_at_once_each_get_half_of_the_time_they_shared():
    # posted together, 1 s and 3 s alone: the small one ends at 2 s (half the link), the big at 4 s
    shares = service_times([(10, 0.0, 2.0), (30, 0.0, 4.0)], channels=2)
    assert shares == [(10, pytest.approx(1.0)), (30, pytest.approx(3.0))]
    # the one-channel reading charges the first with the second's share, and the second with little
    assert service_times([(10, 0.0, 2.0), (30, 0.0, 4.0)], channels=1) == [(10, 2.0), (30, 2.0)]


def test_a_third_collective_waits_for_a_free_worker_in_posting_order():
    events = [(1, 0.0, 2.0), (1, 0.0, 2.0), (1, 0.5, 3.0)]
    assert starts(events, channels=2) == [0.0, 0.0, 2.0]
    assert [t for _, t in service_times(events, channels=2)] == pytest.approx([1.0, 1.0, 1.0])


def test_the_shared_link_runs_up_to_its_channels_sharing_equally():
    link = SharedLink(2)
    assert link.post("a", 0.0, 0.5) == [] and link.post("b", 0.0, 1.5) == []
    assert link.post("c", 0.2, 1.0) == []       # queued: two already run
    assert link.advance(0.9) == []
    assert link.advance(1.0) == [("a", 1.0)]    # a ran at half speed; c starts now
    assert [(k, pytest.approx(t)) for k, t in link.drain()] == [("b", 3.0), ("c", 3.0)]
    assert SharedLink(1, free_at=5.0).post("x", 0.0, 1.0) == [] and SharedLink(1).next_finish() is None


@pytest.mark.parametrize("channels", [1, 2, 3])
def test_the_shares_of_a_replayed_link_are_the_demands_it_was_given(channels):
    """Inverse: collectives replayed on a shared link, their measured (post, finish) read
    back as shares, give each one's demand: what the fits need to recover alpha and beta."""
    rng = random.Random(channels)
    link, demands, posts, finishes, t = SharedLink(channels), {}, {}, {}, 0.0
    for key in range(60):
        t += rng.choice([0.0, 0.0, rng.uniform(0.0, 0.02)])  # bursts, as a backward pass posts them
        nbytes = rng.randint(2**14, 2**22)
        demands[key], posts[key] = (1e-3 + nbytes / 1.25e8, nbytes), t
        finishes.update(link.post(key, t, demands[key][0]))
    finishes.update(link.drain())
    shares = service_times([(demands[k][1], posts[k], finishes[k]) for k in range(60)], channels)
    assert [s for _, s in shares] == pytest.approx([demands[k][0] for k in range(60)], rel=1e-6)


def test_the_what_if_fit_recovers_the_link_under_two_workers():
    from bsrun.profile import whatif

    rng = random.Random(7)
    link, finishes, collectives = SharedLink(2), {}, []
    for key in range(40):
        nbytes = rng.choice([2**18, 2**20, 4 * 2**20])
        collectives.append({"bytes": nbytes, "posted": key * 0.01})
        finishes.update(link.post(key, key * 0.01, 2e-3 + nbytes / 6.25e7))
    finishes.update(link.drain())
    for key, c in enumerate(collectives):
        c["finished"] = finishes[key]
    alpha, beta = whatif.fit_link(collectives, channels=2)
    assert alpha == pytest.approx(2e-3, rel=1e-3) and beta == pytest.approx(1 / 6.25e7, rel=1e-3)
    one_channel_alpha, _ = whatif.fit_link(collectives, channels=1)
    assert abs(one_channel_alpha - 2e-3) > 1e-3  # the old reading misses it


def test_the_replay_shares_the_link_between_the_partitions_the_credit_lets_fly():
    """Credit for two partitions on gloo's two workers: both run at once, so the most
    urgent one arrives when both do; one worker would have sent it first, alone."""
    from bsrun.profile import whatif

    ready, sizes = {0: 0.0, 1: 0.0}, [100, 100]
    shared = whatif._issue_round(ready, sizes, credit=200, alpha=0.0, beta=0.01, decision=0.0, link_free=0.0,
                                 channels=2)
    assert shared == {0: pytest.approx(2.0), 1: pytest.approx(2.0)}
    alone = whatif._issue_round(ready, sizes, credit=200, alpha=0.0, beta=0.01, decision=0.0, link_free=0.0,
                                channels=1)
    assert alone == {0: pytest.approx(1.0), 1: pytest.approx(2.0)}
