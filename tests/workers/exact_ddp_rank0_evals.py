"""A DDP script where only rank 0 evaluates after the loop (a few forward passes over
held-out data, slowly) and saves, while rank 1 leaves at once (--destroy: after
destroy_process_group(); otherwise plain interpreter exit).

Rank 0 saves the model, the optimizer and the evaluation's outputs to --out."""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from exact_common import mlp, start


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--destroy", action="store_true")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    rank, data = start()
    model = mlp(128, 6)
    net = DDP(model)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(a.steps):
        opt.zero_grad()
        x, y = torch.randn(32, 128, generator=data), torch.randint(0, 10, (32,), generator=data)
        F.cross_entropy(net(x), y).backward()
        opt.step()
    if rank == 0:
        held_out = torch.Generator().manual_seed(1000)
        model.eval()
        outputs = []
        with torch.no_grad():
            for _ in range(3):
                time.sleep(0.5)  # the other rank has long left
                outputs.append(model(torch.randn(8, 128, generator=held_out)))
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "eval": torch.stack(outputs)}, a.out)
    if a.destroy:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
