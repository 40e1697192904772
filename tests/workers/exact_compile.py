"""torch.compile with DDP, as users write it: `torch.compile(DDP(model))` (--mode outer) or
`DDP(torch.compile(model))` (--mode inner); Adam, 2 ranks, one batch per rank and step.

Rank 0 saves the final parameters and Adam's state to --out (issue 15's compile case)."""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from exact_common import start


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("outer", "inner"), required=True)
    p.add_argument("--backend", default="aot_eager")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    rank, data = start(data_seed=100)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    if a.mode == "outer":
        net = torch.compile(DDP(model), backend=a.backend)
    else:
        net = DDP(torch.compile(model, backend=a.backend))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(a.steps):
        x, y = torch.randn(16, 32, generator=data), torch.randn(16, 1, generator=data)
        loss = (net(x) - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
