"""DDP + torch.utils.checkpoint with gradient accumulation (no_sync on the first
micro-batch), Adam, as users write it.

--reentrant 1/0 chooses `use_reentrant`. --last-in-ckpt puts the last layer (the head)
inside the last checkpointed segment, so the first gradient of a backward arrives inside a
checkpoint's recomputation (with the reentrant kind, a nested autograd graph task).
--shared uses blocks[0] again outside its checkpoint segment: with the reentrant kind its
gradient arrives twice in one backward, which plain DDP refuses ("Expected to mark a
variable ready only once").

Rank 0 saves the model and optimizer state to --out."""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from exact_common import start
from torch.utils.checkpoint import checkpoint


class Net(nn.Module):
    def __init__(self, reentrant, last_in_ckpt, shared):
        super().__init__()
        self.reentrant, self.last_in_ckpt, self.shared = reentrant, last_in_ckpt, shared
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        x = self.inp(x)
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            if self.last_in_ckpt and i == last:
                x = checkpoint(lambda t, b=block: self.head(b(t)), x, use_reentrant=self.reentrant)
            else:
                x = checkpoint(block, x, use_reentrant=self.reentrant)
        if self.shared:
            x = x + self.blocks[0](x)
        return x if self.last_in_ckpt else self.head(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reentrant", type=int, choices=(0, 1), required=True)
    p.add_argument("--last-in-ckpt", action="store_true")
    p.add_argument("--shared", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    rank, data = start()
    model = Net(bool(a.reentrant), a.last_in_ckpt, a.shared)
    net = DDP(model)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(a.steps):
        opt.zero_grad()
        for micro in range(a.accumulate):
            x, y = torch.randn(16, 32, generator=data), torch.randint(0, 10, (16,), generator=data)
            if micro < a.accumulate - 1:
                with net.no_sync():
                    F.cross_entropy(net(x), y).backward()
            else:
                F.cross_entropy(net(x), y).backward()
        opt.step()
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
