"""The life of a partition, in one place: prepare, ready, do, finish (ByteScheduler's task).

A model's gradients are cut into partitions once, at its first synchronising backward
pass; every round (one synchronising backward pass) each partition then lives through:

- prepare: `Layout(plan_partitions(...))` fixes which pieces of which gradient tensors
  each partition holds (bsrun/sched/partition.py) and the backend stages them
  (bsrun/sched/buffers.py: a zero-copy slice, or a fused staging buffer);
- ready: as each tensor's gradient becomes final, `Layout.tensor_ready` counts it down;
  a partition whose every tensor is ready goes to the scheduler (`Scheduler.mark_ready`);
- do: the scheduler issues partitions by `next_to_issue` (the most urgent that is ready on
  every rank, while the bytes not yet finished stay within the credit) and the backend
  posts the collective (all-reduce, Horovod's named all-reduce, or push + pull to the
  parameter servers);
- finish: the backend waits for it and averages the result into the gradients; then
  `Layout.partition_finished` counts down each tensor's partitions, and a tensor whose
  every partition has finished may be updated (bsrun/inject/runtime.py).

`next_to_issue` is the whole issue rule. bsrun/sched/core.py decides with it on the
ranks' agreed picture; bsrun/profile/whatif.py replays it on a profile's timings, so the
prediction and the scheduler cannot drift apart. `forward_order` is the default priority
both use: first use in the forward pass (a tensor its module's forward reads without
running the module that owns it, beside that module's), then every tensor the pass did
not use.

Pure code: no torch, no threads.
"""

from __future__ import annotations

from typing import AbstractSet, Sequence

from bsrun.sched.partition import Partition


def forward_order(first_use: Sequence[int], names: Sequence[str]) -> list[int]:
    """Tensor indices in first-use order (`first_use`: as their modules' forward passes
    began; `names`: each tensor's dotted parameter name). A tensor whose own module never
    ran goes right after the last used tensor of its nearest enclosing module, which is
    where that module's forward reads it (nn.MultiheadAttention uses `out_proj.weight`
    itself and never calls `out_proj`); left last, its partition would go last and the
    first layer would wait for it. A tensor with no used relative goes last."""
    order = list(dict.fromkeys(first_use))
    placed = set(order)
    for i, name in enumerate(names):
        if i in placed:
            continue
        module, at = name.rpartition(".")[0], len(order)
        while module:
            relatives = [k for k, j in enumerate(order) if names[j].startswith(module + ".")]
            if relatives:
                at = relatives[-1] + 1
                break
            module = module.rpartition(".")[0]
        order.insert(at, i)
        placed.add(i)
    return order


def next_to_issue(candidates: AbstractSet[int], in_flight_bytes: int, sizes: Sequence[int],
                  credit_bytes: int) -> int | None:
    """The partition to issue now, or None: the most urgent candidate (lowest id; ids are
    priorities), if its bytes fit in the credit beside those in flight. With nothing in
    flight anything fits, so a partition larger than the credit still goes, alone."""
    if not candidates:
        return None
    choice = min(candidates)
    if in_flight_bytes and in_flight_bytes + sizes[choice] > credit_bytes:
        return None
    return choice


def credit_charge(nbytes: int, by_rows: bool, partition_bytes: int) -> int:
    """What a partition of `nbytes` holds of the credit while in flight: its bytes, but an
    embedding table sent by its rows (bsrun/sched/row_sparse.py) at most one partition's.
    Charged its dense 16 MB, it waited for everything in flight and went last, though it
    sends ~2 MB."""
    return min(nbytes, partition_bytes) if by_rows else nbytes


def credit_charges(partitions: Sequence[Partition], partition_bytes: int) -> list[int]:
    """`credit_charge` of each partition (what the scheduler is given as their sizes)."""
    return [credit_charge(p.nbytes, bool(p.rows), partition_bytes) for p in partitions]


class Layout:
    """Which partitions hold each tensor, which tensors each partition holds, and the two
    countdowns of a round. `tensor_ready` runs on the training thread and
    `partition_finished` on the scheduler's finisher: each owns its own countdown."""

    def __init__(self, partitions: list[Partition], tensor_count: int):
        self.partitions = partitions
        self.tensors_of = [sorted({pc.tensor for pc in part.pieces}) for part in partitions]
        self.partitions_of: list[list[int]] = [[] for _ in range(tensor_count)]
        for part in partitions:
            for pc in part.pieces:
                self.partitions_of[pc.tensor].append(part.pid)
        self._tensors_waiting = [len(t) for t in self.tensors_of]
        self._partitions_left = [len(ps) for ps in self.partitions_of]

    def tensor_ready(self, tensor: int) -> list[int]:
        """Tensor's gradient is final this round: the partitions that are now whole."""
        whole = []
        for pid in self.partitions_of[tensor]:
            self._tensors_waiting[pid] -= 1
            if self._tensors_waiting[pid] == 0:
                self._tensors_waiting[pid] = len(self.tensors_of[pid])  # ready for the next round
                whole.append(pid)
        return whole

    def partition_finished(self, pid: int) -> list[int]:
        """Partition's collective is done: the tensors whose every partition is now done."""
        done = []
        for tensor in self.tensors_of[pid]:
            self._partitions_left[tensor] -= 1
            if self._partitions_left[tensor] == 0:
                self._partitions_left[tensor] = len(self.partitions_of[tensor])
                done.append(tensor)
        return done
