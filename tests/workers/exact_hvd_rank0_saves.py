"""A Horovod script where only rank 0 saves after the loop (and then every rank just exits:
Horovod's own atexit shutdown, no hvd.shutdown() call), as users write it.

Rank 0 saves the model state to --out."""

import argparse

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(6)], nn.Linear(128, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.Generator().manual_seed(hvd.rank())
    for _ in range(a.steps):
        opt.zero_grad()
        x, y = torch.randn(32, 128, generator=data), torch.randint(0, 10, (32,), generator=data)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    if hvd.rank() == 0:
        torch.save(model.state_dict(), a.out)


if __name__ == "__main__":
    main()
