"""CommBackend over Horovod: each partition one named asynchronous all-reduce.

Horovod's coordinator runs a collective only once every rank has submitted its name, so
the ranks need no agreement of their own: `negotiate` returns this rank's picture
unchanged. As in ByteScheduler's Horovod plugin, only rank 0 holds back by priority and
credit (the runtime gives the other ranks an unbounded credit, so they submit each
partition as soon as it is ready there); the order in which rank 0 submits is then the
order in which Horovod runs them, and no rank can wait on a partition that another rank
holds back. Averaging is Horovod's own (op Average with its pre/post scale factors), so
results match plain `hvd.DistributedOptimizer`.
"""

from __future__ import annotations

from typing import Sequence

import horovod.torch as hvd

from bsrun.sched.buffers import PartitionBuffers


class HorovodBackend(PartitionBuffers):
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

    def wait(self, handle) -> None:
        pid, hvd_handle = handle
        hvd.synchronize(hvd_handle)
        self.unpack(pid)

    def negotiate(self, values: Sequence[int]) -> list[int]:
        return list(values)
