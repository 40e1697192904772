"""The scheduler core: partitions, priority, credit and cross-rank agreement."""

import json
import random
import threading
import time

import pytest

from bsrun.sched.partition import TensorInfo, plan_partitions
from conftest import WORKERS, assert_scheduled, bsrun_env, last_run, run_bsrun


def info(numel, dtype="f32"):
    return TensorInfo(numel, 4, dtype)


def test_large_tensors_are_cut_into_near_equal_pieces_no_larger_than_the_partition():
    parts = plan_partitions([info(1000)], [0], partition_bytes=1200)  # 300 elements a piece at most
    assert [p.pieces[0].start for p in parts] == [0, 250, 500, 750]
    assert all(p.nbytes <= 1200 for p in parts)
    assert parts[-1].pieces[0].stop == 1000


def test_small_tensors_are_fused_in_priority_order_up_to_the_partition():
    tensors = [info(10), info(10), info(10), info(500)]
    parts = plan_partitions(tensors, [3, 2, 1, 0], partition_bytes=100)
    assert [p.pid for p in parts] == list(range(len(parts)))
    assert parts[0].pieces[0].tensor == 3, "the most urgent tensor comes first"
    fused = [p for p in parts if p.fused]
    assert len(fused) == 1 and [pc.tensor for pc in fused[0].pieces] == [2, 1]
    assert [pc.tensor for p in parts for pc in p.pieces][-1] == 0


def test_the_most_urgent_partitions_fuse_less_so_the_last_ready_gradients_go_early():
    """The first partitions hold the first layers, the last the backward pass makes: they
    fuse up to an eighth, a quarter, a half of the partition size, then the size itself.
    A tensor above its partition's cap but within the size still goes whole."""
    kib = 1024 // 4  # elements of 1 KiB
    parts = plan_partitions([info(64 * kib)] * 200, list(range(200)), partition_bytes=4 << 20)
    assert [p.nbytes >> 10 for p in parts[:5]] == [512, 1024, 2048, 4096, 4096]
    assert [pc.tensor for p in parts for pc in p.pieces] == list(range(200)), "priority order kept"
    whole = plan_partitions([info(1024 * kib), info(64 * kib)], [0, 1], partition_bytes=4 << 20)
    assert [[(pc.tensor, pc.start, pc.stop) for pc in p.pieces] for p in whole] == \
        [[(0, 0, 1024 * kib)], [(1, 0, 64 * kib)]]
    assert len(plan_partitions([info(64 * kib)] * 8, list(range(8)), 256 << 10)) == 2, \
        "no ramp at or under 256 KiB: it would only add collectives"


def test_fusion_never_mixes_dtypes():
    parts = plan_partitions([info(4, "f32"), info(4, "f16"), info(4, "f32")], [0, 1, 2], 1000)
    assert [len(p.pieces) for p in parts] == [1, 1, 1]


def test_a_tensor_whose_module_never_runs_is_ordered_where_its_enclosing_module_reads_it():
    """nn.MultiheadAttention reads out_proj.weight itself and never calls out_proj: its
    tensors go beside the attention's own, not after the whole model (the first layer
    would then wait for the last partition); a tensor with no used relative stays last."""
    from bsrun.sched.task import forward_order

    names = ["embed.weight", "layers.0.attn.in_proj_weight", "layers.0.attn.out_proj.weight",
             "layers.0.attn.out_proj.bias", "layers.0.ff.weight", "layers.1.attn.in_proj_weight",
             "layers.1.attn.out_proj.weight", "layers.1.ff.weight", "head.weight", "spare.weight"]
    used = [0, 1, 4, 5, 7, 8]  # as the modules' forward pre-hooks fired
    assert forward_order(used, names) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert forward_order(list(range(10)), names) == list(range(10))


def test_order_must_be_a_permutation():
    with pytest.raises(ValueError):
        plan_partitions([info(4), info(4)], [0, 0], 100)


@pytest.mark.slow
@pytest.mark.parametrize("jitter", [0.0, 0.01], ids=["no-jitter", "random-sleeps"])
def test_ranks_agree_on_the_order_whatever_their_timing(workdir, jitter):
    out = workdir / "orders.json"
    run_bsrun(["-np", 2, "python", WORKERS / "sched_order.py", 6, jitter, out], cwd=workdir,
              check=True, timeout=180)
    result = json.loads(out.read_text())
    orders = result["orders"]
    assert len(orders[0]) == 6 * result["partitions"]
    assert orders[0] == orders[1], "both ranks must issue the same collectives in the same order"
    assert result["stats"]["rounds"] == 6
    # one gloo group matches collectives by order: after the first round every rank replays it
    assert result["stats"]["replayed_rounds"] == 5 and result["stats"]["negotiations"] >= 1


class ScriptedBackend:
    """One rank whose collectives finish when the test says so: the scheduler's decisions
    can then be driven by a timeline, event by event."""

    world_size = 1
    in_order = True

    def __init__(self, matched_by_order=False):
        self.matched_by_order = matched_by_order
        self.posted: list[int] = []
        self.finished: dict[int, threading.Event] = {}

    def post(self, pid):
        self.finished[pid] = threading.Event()
        self.posted.append(pid)
        return pid

    def test(self, pid):
        return self.finished[pid].is_set()

    def wait(self, pid):
        assert self.finished[pid].wait(30), f"partition {pid} was never released"

    def sent_bytes(self, pid, handle):
        return 0

    def negotiate(self, values):
        return list(values)


def settle(scheduler, backend, quiet_s=0.05, limit_s=5.0):
    """Until the scheduler has made every decision the last event allows (nothing new for
    `quiet_s`)."""
    deadline = time.monotonic() + limit_s
    seen = None
    while time.monotonic() < deadline:
        now = (len(backend.posted), scheduler.stats["negotiations"], scheduler.stats["partitions"])
        if now == seen:
            return
        seen = now
        time.sleep(quiet_s)


@pytest.mark.parametrize("credit", [150, 400, 10**9], ids=["one-at-a-time", "a-few", "unlimited"])
def test_the_replay_and_the_scheduler_make_the_same_issue_decisions(credit):
    """One rule, two callers: the what-if replay's issue order for a round is the order in
    which the real scheduler core posts when the same readiness and finishes reach it."""
    from bsrun.profile import whatif
    from bsrun.sched.core import Scheduler

    rng = random.Random(credit)
    count = 10
    sizes = [rng.randint(50, 300) for _ in range(count)]
    # As a backward pass makes them ready: the least urgent (highest id) first, with jitter.
    ready = {p: (count - p) * 1.0 + rng.uniform(0.0, 0.6) for p in range(count)}
    finish = whatif._issue_round(ready, sizes, sizes, credit, alpha=0.4, beta=0.01, decision=0.0, link_free=0.0)
    replayed = sorted(finish, key=finish.get)  # one link, first come first served

    backend = ScriptedBackend()
    done: list[int] = []
    scheduler = Scheduler(backend, sizes, credit, done.append, lambda e: done.append(e))
    try:
        events = sorted([(t, 0, p) for p, t in finish.items()] + [(t, 1, p) for p, t in ready.items()])
        for _, kind, pid in events:
            if kind == 0:
                assert pid in backend.posted, f"the replay finishes {pid}, the scheduler never posted it"
                backend.finished[pid].set()
            else:
                scheduler.mark_ready(pid)
            settle(scheduler, backend)
    finally:
        for event in backend.finished.values():
            event.set()
        scheduler.close()
    assert backend.posted == replayed
    assert sorted(done) == list(range(count))
    if credit == 150:  # the credit really decided something: urgency beat readiness
        assert replayed != sorted(ready, key=ready.get)


def test_steady_rounds_replay_the_negotiated_order_within_the_credit():
    """On a backend matched by posting order, round 0 is negotiated and later rounds post in
    its order without negotiating: a partition ready early waits for the ones before it in
    that order, and the credit still holds back what does not fit beside this round's
    unfinished bytes."""
    from bsrun.sched.core import RENEGOTIATE_EVERY, Scheduler

    sizes = [100, 100, 100]
    backend = ScriptedBackend(matched_by_order=True)
    done: list = []
    scheduler = Scheduler(backend, sizes, 200, done.append, done.append)
    try:
        for pid in (2, 1, 0):  # round 0, as a backward pass readies them: negotiated
            scheduler.mark_ready(pid)
            settle(scheduler, backend)
        assert backend.posted == [2, 1]  # 0 waits for the credit
        backend.finished[2].set()
        settle(scheduler, backend)
        assert backend.posted == [2, 1, 0]
        backend.finished[1].set(), backend.finished[0].set()
        settle(scheduler, backend)
        negotiated = scheduler.stats["negotiations"]

        scheduler.mark_ready(1)  # round 1: 1 is ready first, but round 0's order starts with 2
        settle(scheduler, backend)
        assert backend.posted[3:] == []
        scheduler.mark_ready(2), scheduler.mark_ready(0)
        settle(scheduler, backend)
        assert backend.posted[3:] == [2, 1]  # in round 0's order, 0 held back by the credit
        backend.finished[2].set()
        settle(scheduler, backend)
        assert backend.posted[3:] == [2, 1, 0]
        assert scheduler.stats["negotiations"] == negotiated and scheduler.stats["replayed_rounds"] == 1
        backend.finished[1].set(), backend.finished[0].set()
        settle(scheduler, backend)
    finally:
        for event in backend.finished.values():
            event.set()
        scheduler.close()
    assert [d for d in done if not isinstance(d, int)] == []  # no error
    assert sorted(done) == [0, 0, 1, 1, 2, 2] and RENEGOTIATE_EVERY > 1


def gloo_event_loops(workdir, *options, **env):
    """Each rank's line "rank R: N gloo event loops" after three DDP steps, and the run."""
    proc = run_bsrun([*options, "-np", 2, "python", WORKERS / "ddp_smoke.py"], cwd=workdir,
                     env=bsrun_env(COUNT_GLOO_LOOPS="1", **env), check=True)
    lines = [line[line.index("rank "):] for line in proc.stdout.splitlines() if "gloo event loops" in line]
    return sorted(lines), proc  # less the launcher's "[R] " prefix


def test_bsrun_groups_add_no_gloo_event_loop_threads(workdir):
    """bsrun's three gloo groups live on the default group's gloo device: a scheduled rank
    runs as many gloo event loop threads as plain DDP's (each wakes every 10 ms, idle or not,
    and on two cores they preempted the training thread: BENCHMARKS.md, fifteenth pass)."""
    plain, _ = gloo_event_loops(workdir, "--no-schedule")
    scheduled, proc = gloo_event_loops(workdir)
    assert_scheduled(last_run(workdir), context=proc.stdout + proc.stderr)
    assert plain == ["rank 0: 1 gloo event loops", "rank 1: 1 gloo event loops"]
    assert scheduled == plain


def test_a_torch_without_gloo_device_options_gets_torchs_own_groups_said_once(workdir):
    """Where gloo's private device options are missing (removed here, as a later torch may
    drop them), bsrun's groups are torch's plain gloo groups: scheduled all the same, one
    event loop each, and rank 0 says so once."""
    loops, proc = gloo_event_loops(workdir, NO_GLOO_OPTIONS="1")
    assert_scheduled(last_run(workdir), context=proc.stdout + proc.stderr)
    assert loops == ["rank 0: 4 gloo event loops", "rank 1: 4 gloo event loops"]
    assert proc.stderr.count("has no gloo device options") == 1, proc.stderr
