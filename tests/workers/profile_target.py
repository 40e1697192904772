"""A small DDP training script for the profile tests: nested modules, BatchNorm, in-place
ReLU, a few hundred KB of gradients. --out: rank 0 saves the final model state."""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
                                      nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True),
                                      nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Linear(32 * 4 * 4, 256), nn.ReLU(inplace=True), nn.Linear(256, 10))

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per step (for interrupting)")
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(7 + rank)
    for _ in range(a.steps):
        x = torch.randn(8, 3, 16, 16, generator=data)
        y = torch.randint(0, 10, (8,), generator=data)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(a.sleep)
    if rank == 0 and a.out:
        torch.save(model.module.state_dict(), a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
