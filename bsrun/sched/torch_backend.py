"""The torch.distributed transport: one all-reduce per partition, negotiations apart.

An embedding table's partition (`Partition.rows`) is two: its nonzero rows are agreed,
then only those are all-reduced (bsrun/sched/row_sparse.py).

A model's ranks talk over three gloo groups of bsrun's own (`TorchTransport`): gradient
bytes (the backend's collectives), negotiations (the scheduler's control thread) and
the training thread's collectives (agreeing on the order, broadcasting buffers). So a
negotiation waits only behind the network's queue, never behind megabytes of gradients
on the same connection, and no two threads ever share a group. The result is averaged in
place (sum / world size), as DDP does.

A transport may be given a `reduce` callable before its backend is made (a DDP comm hook,
adapted by bsrun/inject/comm_hooks.py): `reduce(partition, data, group, last)` is called
on the control thread in place of the all-reduce and returns a torch.futures.Future of
the averaged flat tensor; `last` says this is the round's last partition to be posted.
It must issue its collectives only on `group` (the data group), so that they stay in the
agreed order; the finisher waits for the future and copies its value into the gradients.
"""

from __future__ import annotations

import functools
import sys
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from bsrun.sched.buffers import PartitionBuffers
from bsrun.sched.row_sparse import RowSparseAllReduce


class TorchDistBackend(PartitionBuffers):
    in_order = True  # one process group runs its collectives in the order they were posted
    matched_by_order = True  # and pairs them across ranks by that order

    def __init__(self, data_group, negotiation_group, partitions, grad_of, dtypes, reduce=None):
        super().__init__(partitions, grad_of, dtypes)
        self.data_group = data_group
        self.negotiation_group = negotiation_group
        self.world_size = dist.get_world_size(data_group)
        self.reduce = reduce
        self._posted = 0  # partitions posted so far (each round posts every partition once)

    def post(self, pid: int):
        part = self.partitions[pid]
        if part.rows:  # laid out so only while `reduce` is None (TorchTransport.row_sparse)
            grad = self.grad_of(part.pieces[0].tensor)
            return pid, None, RowSparseAllReduce(grad.view(part.rows, -1), self.data_group, self.world_size)
        data = self.pack(pid)
        if self.reduce is None:
            return pid, data, dist.all_reduce(data, group=self.data_group, async_op=True)
        self._posted += 1
        last = self._posted % len(self.partitions) == 0
        return pid, data, self.reduce(self.partitions[pid], data, self.data_group, last)

    def test(self, handle) -> bool:
        work = handle[2]
        return work.done() if self.reduce is not None else work.is_completed()

    def wait(self, handle) -> None:
        pid, data, work = handle
        if isinstance(work, RowSparseAllReduce):
            work.finish()
        elif self.reduce is None:
            work.wait()
            data.div_(self.world_size)
        else:
            result = work.wait()  # a hook's own averaging; its error is raised here
            if result is not data:
                data.copy_(result.view(-1))
        self.unpack(pid)

    def sent_bytes(self, pid: int, handle) -> int:
        work = handle[2]
        return work.sent_bytes if isinstance(work, RowSparseAllReduce) else super().sent_bytes(pid, handle)

    def negotiate(self, values: Sequence[int]) -> list[int]:
        negated = -torch.tensor(values, dtype=torch.int64)  # min = -max(-x); gloo has MAX
        dist.all_reduce(negated, op=dist.ReduceOp.MAX, group=self.negotiation_group)
        return (-negated).tolist()


_SHARED_GLOO = "bsrun_gloo"  # gloo on the process's one gloo device (`gloo_group`)


@functools.cache
def _shared_gloo_device():
    """The default group's gloo device (or one of bsrun's, made once), or None where this
    torch lacks gloo's private device options (then every group gets its own device)."""
    options = getattr(dist.ProcessGroupGloo, "_Options", None)
    if options is None or not hasattr(options(), "_devices"):
        return None
    default = dist.distributed_c10d._get_default_group()
    try:
        devices = default._get_backend(torch.device("cpu")).options._devices
    except (RuntimeError, AttributeError):  # the default group is not gloo's
        devices = []
    return devices[0] if devices else dist.ProcessGroupGloo.create_default_device()


def _gloo_on_the_shared_device(store, rank: int, size: int, timeout: timedelta):
    """A gloo backend whose connections live on the shared gloo device, so on its event
    loop thread. Every gloo device runs a thread that wakes every 10 ms even when idle;
    torch's new_group makes a device per group, and bsrun's three groups' idle wake-ups
    doubled the training thread's preemptions on two cores (BENCHMARKS.md, fifteenth pass)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [_shared_gloo_device()]
    return dist.ProcessGroupGloo(store, rank, size, options)


def gloo_group(ranks: list[int] | None, timeout: timedelta | None = None):
    """A gloo process group of these ranks (every rank if None) on the shared gloo device:
    the same collectives and connections of its own, no event loop thread of its own.
    (torch's new_group ignores gloo's device options, so it goes by a registered backend.)
    Where this torch has no device options, or no backend registry, it is torch's plain
    gloo group: the same collectives, one more idle thread; rank 0 says so once."""
    shared = hasattr(dist.Backend, "register_backend") and _shared_gloo_device() is not None
    local = ranks is not None
    if not shared:
        _say_plain_gloo_once()
        return dist.new_group(ranks, timeout=timeout, backend="gloo", use_local_synchronization=local)
    if not hasattr(dist.Backend, _SHARED_GLOO.upper()):
        dist.Backend.register_backend(_SHARED_GLOO, _gloo_on_the_shared_device, devices=["cpu"])
    return dist.new_group(ranks, timeout=timeout, backend=_SHARED_GLOO, use_local_synchronization=local)


@functools.cache
def _say_plain_gloo_once() -> None:
    if dist.get_rank() == 0:
        print(f"bsrun: torch {torch.__version__} has no gloo device options: each of bsrun's groups runs its "
              "own gloo event loop (more idle wake-ups on few cores; parameters unchanged)",
              file=sys.stderr, flush=True)


class TorchTransport:
    """A model's ranks over three gloo groups of their own (see the module's docstring)."""

    def __init__(self, ranks: list[int], timeout: timedelta):
        self.reduce = None  # see the module's docstring; set before the first backward pass
        self.data_group, self.negotiation_group, self.control_group = (gloo_group(ranks, timeout) for _ in range(3))

    @property
    def row_sparse(self) -> bool:
        """Embedding tables go by their nonzero rows (bsrun/sched/row_sparse.py); a comm hook
        gets every partition dense, as DDP's buckets."""
        return self.reduce is None

    def agree(self, values: list[int]) -> list[int]:
        return self.agree_later(values)()

    def agree_later(self, values: list[int]):
        tensor = torch.tensor(values, dtype=torch.int64)
        work = dist.broadcast(tensor, src=dist.get_global_rank(self.control_group, 0), group=self.control_group,
                              async_op=True)

        def result() -> list[int]:
            work.wait()
            return tensor.tolist()
        return result

    def backend(self, partitions, grad_of, dtypes) -> TorchDistBackend:
        return TorchDistBackend(self.data_group, self.negotiation_group, partitions, grad_of, dtypes,
                                self.reduce)

    def credit(self, credit_bytes: int) -> int:
        return credit_bytes
