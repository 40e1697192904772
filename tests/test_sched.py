"""The scheduler core: partitions, priority, credit and cross-rank agreement."""

import json

import pytest

from bsrun.sched.partition import TensorInfo, plan_partitions
from conftest import WORKERS, run_bsrun


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


def test_fusion_never_mixes_dtypes():
    parts = plan_partitions([info(4, "f32"), info(4, "f16"), info(4, "f32")], [0, 1, 2], 1000)
    assert [len(p.pieces) for p in parts] == [1, 1, 1]


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
