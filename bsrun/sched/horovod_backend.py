"""CommBackend over Horovod: each partition one named asynchronous all-reduce.

Horovod's coordinator runs a collective only once every rank has submitted its name, so
the ranks need no agreement of their own: `negotiate` returns this rank's picture
unchanged. As in ByteScheduler's Horovod plugin, only rank 0 holds back by priority and
credit (the runtime gives the other ranks an unbounded credit, so they submit each
partition as soon as it is ready there); the order in which rank 0 submits is then the
order in which Horovod runs them, and no rank can wait on a partition that another rank
holds back. They finish in Horovod's order, not in the order this rank posted them, so
the core polls them (`in_order = False`) rather than wait for the oldest. Averaging is
Horovod's own (op Average with its pre/post scale factors), so results match plain
`hvd.DistributedOptimizer`.

`HorovodTransport` holds that policy: rank 0's credit is the config's, every other
rank's is unlimited; agreement is a named Horovod broadcast.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import horovod.torch as hvd
import torch

from bsrun.config import UNLIMITED_CREDIT
from bsrun.sched.buffers import PartitionBuffers

_MODEL_NUMBERS = itertools.count()  # the same sequence on every rank: names Horovod can match


class HorovodBackend(PartitionBuffers):
    in_order = False  # Horovod runs them in rank 0's order, and other ranks post in theirs
    matched_by_order = False  # matched by name; its negotiate is local

    def __init__(self, name: str, op, prescale: float, postscale: float, partitions, grad_of, dtypes):
        """`name`: a prefix the same on every rank and unique to this model."""
        super().__init__(partitions, grad_of, dtypes)
        self.name = name
        self.op = op
        self.prescale = prescale
        self.postscale = postscale
        self.world_size = hvd.size()

    def post(self, pid: int):
        data = self.pack(pid)
        handle = hvd.allreduce_async_(data, name=f"{self.name}.p{pid}", op=self.op,
                                      prescale_factor=self.prescale, postscale_factor=self.postscale)
        return pid, handle

    def test(self, handle) -> bool:
        return hvd.poll(handle[1])

    def wait(self, handle) -> None:
        """Called once test() is true. (Horovod's blocking wait sleeps holding the GIL,
        pybind11 without a release, which would stall the training thread meanwhile;
        so the core polls instead.)"""
        pid, hvd_handle = handle
        hvd.synchronize(hvd_handle)  # done: returns at once, frees the handle, raises its error
        self.unpack(pid)

    def negotiate(self, values: Sequence[int]) -> list[int]:
        return list(values)


class HorovodTransport:
    row_sparse = False  # every partition one named dense all-reduce
    def __init__(self, op, gradient_predivide_factor: float):
        self.name = f"bsrun.{next(_MODEL_NUMBERS)}"
        self._layouts = itertools.count()
        self.op = op
        average = op == hvd.Average
        self.prescale = 1.0 / gradient_predivide_factor if average else 1.0
        self.postscale = gradient_predivide_factor if average else 1.0

    def agree(self, values: list[int]) -> list[int]:
        return self._broadcast(values, "agree")()

    def agree_later(self, values: list[int]):
        """Under a name of its own: a blocking agree() (the replica check) may run while it is in flight."""
        return self._broadcast(values, "agree_later")

    def _broadcast(self, values: list[int], name: str):
        handle = hvd.broadcast_async(torch.tensor(values, dtype=torch.int64), root_rank=0, name=f"{self.name}.{name}")
        return lambda: hvd.synchronize(handle).tolist()

    def backend(self, partitions, grad_of, dtypes) -> HorovodBackend:
        """Each layout's partitions under names of their own (every rank lays out as often,
        at the same steps): a partition id of a new layout is another tensor, of another
        size, and Horovod matches and caches collectives by name."""
        layout = next(self._layouts)
        return HorovodBackend(f"{self.name}.l{layout}", self.op, self.prescale, self.postscale,
                              partitions, grad_of, dtypes)

    def credit(self, credit_bytes: int) -> int:
        """Rank 0 alone holds back; the others submit all that is ready (see above)."""
        return credit_bytes if hvd.rank() == 0 else UNLIMITED_CREDIT
