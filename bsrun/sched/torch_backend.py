"""CommBackend over torch.distributed: one all-reduce per partition, negotiations apart.

Gradient bytes go over one process group, negotiations over another, so a negotiation
waits only behind the network's queue, never behind megabytes of gradients on the same
connection. A partition of one large gradient is a zero-copy slice of it; a fused
partition of small gradients goes through a staging buffer allocated once. The result is
averaged in place (sum / world size), as DDP does.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from bsrun.sched.partition import Partition


class TorchDistBackend:
    def __init__(self, data_group, negotiation_group, partitions: list[Partition],
                 grad_of: Callable[[int], torch.Tensor], dtypes: dict[str, torch.dtype]):
        """`grad_of(tensor_index)` returns that tensor's current (contiguous) gradient."""
        self.data_group = data_group
        self.negotiation_group = negotiation_group
        self.world_size = dist.get_world_size(data_group)
        self.partitions = partitions
        self.grad_of = grad_of
        self.staging = {p.pid: torch.empty(sum(pc.stop - pc.start for pc in p.pieces), dtype=dtypes[p.dtype])
                        for p in partitions if p.fused}

    def _pieces(self, part: Partition):
        """(slice of the staging buffer, slice of the gradient) for each piece."""
        offset = 0
        for pc in part.pieces:
            n = pc.stop - pc.start
            yield self.staging[part.pid][offset:offset + n], self.grad_of(pc.tensor).view(-1)[pc.start:pc.stop]
            offset += n

    def post(self, pid: int):
        part = self.partitions[pid]
        if part.fused:
            for staged, grad in self._pieces(part):
                staged.copy_(grad)
            data = self.staging[pid]
        else:
            pc = part.pieces[0]
            data = self.grad_of(pc.tensor).view(-1)[pc.start:pc.stop]
        return part, data, dist.all_reduce(data, group=self.data_group, async_op=True)

    def wait(self, handle) -> None:
        part, data, work = handle
        work.wait()
        data.div_(self.world_size)
        if part.fused:
            for staged, grad in self._pieces(part):
                grad.copy_(staged)

    def negotiate(self, values: Sequence[int]) -> list[int]:
        negated = -torch.tensor(values, dtype=torch.int64)  # min = -max(-x); gloo has MAX
        dist.all_reduce(negated, op=dist.ReduceOp.MAX, group=self.negotiation_group)
        return (-negated).tolist()
