"""An ordinary DDP training script: a small CNN on synthetic CIFAR-sized data.

Runs unmodified under torchrun and under bsrun:
    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py
    bsrun -np 2 python examples/train_ddp.py
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class SmallCNN(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(64)
        self.fc1 = nn.Linear(64 * 8 * 8, 256)
        self.fc2 = nn.Linear(256, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32, help="per-worker batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(SmallCNN())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + rank)

    start = time.perf_counter()
    for step in range(args.steps):
        x = torch.randn(args.batch, 3, 32, 32, generator=data)
        y = torch.randint(0, 10, (args.batch,), generator=data)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if rank == 0 and (step + 1) % 10 == 0:
            rate = (step + 1) * args.batch * world / (time.perf_counter() - start)
            print(f"step {step + 1}: loss {loss.item():.4f}, {rate:.0f} samples/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
