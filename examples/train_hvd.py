"""An ordinary Horovod training script: the same small CNN on synthetic CIFAR-sized data.

Runs unmodified under horovodrun and under bsrun:
    horovodrun --gloo -np 2 -H localhost:2 python examples/train_hvd.py
    bsrun -np 2 python examples/train_hvd.py
    bsrun horovodrun --gloo -np 2 -H localhost:2 python examples/train_hvd.py
"""

import argparse
import os
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from train_ddp import SmallCNN


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32, help="per-worker batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
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


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
