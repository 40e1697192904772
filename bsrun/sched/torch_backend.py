"""CommBackend over torch.distributed: one all-reduce per partition, negotiations apart.

Gradient bytes go over one process group, negotiations over another, so a negotiation
waits only behind the network's queue, never behind megabytes of gradients on the same
connection. The result is averaged in place (sum / world size), as DDP does.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from bsrun.sched.buffers import PartitionBuffers


class TorchDistBackend(PartitionBuffers):
    in_order = True  # one process group runs its collectives in the order they were posted

    def __init__(self, data_group, negotiation_group, partitions, grad_of, dtypes):
        super().__init__(partitions, grad_of, dtypes)
        self.data_group = data_group
        self.negotiation_group = negotiation_group
        self.world_size = dist.get_world_size(data_group)

    def post(self, pid: int):
        data = self.pack(pid)
        return pid, data, dist.all_reduce(data, group=self.data_group, async_op=True)

    def test(self, handle) -> bool:
        return handle[2].is_completed()

    def wait(self, handle) -> None:
        pid, data, work = handle
        work.wait()
        data.div_(self.world_size)
        self.unpack(pid)

    def negotiate(self, values: Sequence[int]) -> list[int]:
        negated = -torch.tensor(values, dtype=torch.int64)  # min = -max(-x); gloo has MAX
        dist.all_reduce(negated, op=dist.ReduceOp.MAX, group=self.negotiation_group)
        return (-negated).tolist()
