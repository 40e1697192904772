"""The bytes of a partition: a zero-copy slice of one gradient, or a fused staging buffer.

Shared by every backend that moves partitions with an in-place collective: `pack(pid)`
gives the tensor to reduce, `unpack(pid, data)` puts a fused result back into the
gradients it came from (a slice needs nothing: it was reduced in place).
"""

from __future__ import annotations

from typing import Callable

import torch

from bsrun.sched.partition import Partition


class PartitionBuffers:
    def __init__(self, partitions: list[Partition], grad_of: Callable[[int], torch.Tensor],
                 dtypes: dict[str, torch.dtype]):
        """`grad_of(tensor_index)` returns that tensor's current (contiguous) gradient."""
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

    def pack(self, pid: int) -> torch.Tensor:
        part = self.partitions[pid]
        if not part.fused:
            pc = part.pieces[0]
            return self.grad_of(pc.tensor).view(-1)[pc.start:pc.stop]
        for staged, grad in self._pieces(part):
            staged.copy_(grad)
        return self.staging[pid]

    def sent_bytes(self, pid: int, handle) -> int:
        """The bytes this rank reduced for the partition (the run summary's `bytes`)."""
        return self.partitions[pid].nbytes

    def unpack(self, pid: int) -> None:
        part = self.partitions[pid]
        if part.fused:
            for staged, grad in self._pieces(part):
                grad.copy_(staged)
