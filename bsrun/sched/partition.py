"""Cut gradients into partitions, in the order the next forward pass needs them.

Tensors are taken in priority order (first use in the forward pass). A tensor larger
than the partition size is cut into near-equal pieces no larger than it (zero-copy slices
of the flattened gradient); consecutive small tensors of one dtype are fused into one
partition up to the partition size, so a model of many small tensors does not pay one
collective's latency for each. A partition size of 0 keeps every tensor whole and
alone (the unscheduled baselines' granularity), and so does an embedding table that is
sent by its nonzero rows (`TensorInfo.rows`, bsrun/sched/row_sparse.py).

The most urgent fused partitions are smaller (`ramp_caps`: an eighth of the partition
size, doubling up to it). They hold the first layers of the forward pass, whose gradients
are the last the backward pass makes, so a partition is held until its last tensor is
ready: a whole 4 MiB partition 0 of ResNet-50 (stem to stages.8) sat complete but unsent
while the backward pass computed its last 100 ms, then its transfer (33 ms at 1 Gbit/s)
came entirely after the pass, on the next forward's critical path. Partition ids are assigned in priority order, so
"lowest id first" is the whole priority rule and ties cannot happen.

`ddp_buckets` is the other layout in this project: torch DDP's own buckets, which the
benchmark's bound mode and the what-if replay of an unscheduled run both reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    tensor: int   # index of the tensor in the caller's list
    start: int    # element range [start, stop) of the flattened tensor
    stop: int


@dataclass(frozen=True)
class Partition:
    pid: int
    pieces: tuple[Piece, ...]
    nbytes: int
    dtype: str
    rows: int = 0  # > 0: an embedding table's gradient, whole, sent by its nonzero rows

    @property
    def fused(self) -> bool:
        return len(self.pieces) > 1


@dataclass(frozen=True)
class TensorInfo:
    numel: int
    element_size: int
    dtype: str
    rows: int = 0  # > 0: may go row-sparse (bsrun/sched/row_sparse.py): kept whole and alone


RAMP_STEPS = 3               # partition 0 fuses up to partition_bytes / 2**3, then doubling
RAMP_FLOOR = 256 * 1024      # no ramped partition is smaller (one collective's fixed cost)


def ramp_caps(partition_bytes: int) -> list[int]:
    """The fusing limits of partitions 0, 1, ... before the partition size applies."""
    floor = min(partition_bytes, RAMP_FLOOR)
    return [max(partition_bytes >> (RAMP_STEPS - k), floor) for k in range(RAMP_STEPS)]


def plan_partitions(tensors: list[TensorInfo], order: list[int], partition_bytes: int) -> list[Partition]:
    """`order` lists tensor indices, most urgent first; returns partitions, most urgent first.
    Small tensors fuse up to `ramp_caps` in the first partitions, then up to the partition size;
    a tensor above the partition size is cut into pieces no larger."""
    if sorted(order) != list(range(len(tensors))):
        raise ValueError("order must be a permutation of the tensor indices")
    partitions: list[Partition] = []
    group: list[Piece] = []
    group_bytes = 0
    caps = ramp_caps(partition_bytes)

    def cap() -> int:
        return caps[len(partitions)] if len(partitions) < len(caps) else partition_bytes

    def close_group():
        nonlocal group, group_bytes
        if group:
            partitions.append(Partition(len(partitions), tuple(group), group_bytes,
                                        tensors[group[0].tensor].dtype))
        group, group_bytes = [], 0

    for index in order:
        info = tensors[index]
        nbytes = info.numel * info.element_size
        if nbytes == 0:
            continue
        if partition_bytes == 0 or info.rows:
            close_group()
            partitions.append(Partition(len(partitions), (Piece(index, 0, info.numel),), nbytes, info.dtype,
                                        info.rows))
            continue
        if nbytes > partition_bytes:
            close_group()
            per_piece = max(1, partition_bytes // info.element_size)
            count = -(-info.numel // per_piece)
            step = -(-info.numel // count)  # near-equal pieces, none above the partition size
            for start in range(0, info.numel, step):
                stop = min(info.numel, start + step)
                partitions.append(Partition(len(partitions), (Piece(index, start, stop),),
                                            (stop - start) * info.element_size, info.dtype))
            continue
        if group and (group_bytes + nbytes > cap() or tensors[group[0].tensor].dtype != info.dtype):
            close_group()
        group.append(Piece(index, 0, info.numel))
        group_bytes += nbytes
    close_group()
    return partitions


# torch DDP's defaults (2.x): the first bucket closes at 1 MiB so communication starts
# early, the others at 25 MiB; buckets fill in the order gradients become ready.
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
DDP_BUCKET_BYTES = 25 * 1024 * 1024


def ddp_buckets(nbytes: list[int]) -> list[list[int]]:
    """DDP's buckets over tensors of these sizes, taken in the order given (gradient-ready
    order): each bucket is a list of positions in `nbytes`."""
    buckets, current, size = [], [], 0
    for position, n in enumerate(nbytes):
        current.append(position)
        size += n
        if size >= (DDP_FIRST_BUCKET_BYTES if not buckets else DDP_BUCKET_BYTES):
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
