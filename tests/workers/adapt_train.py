"""An MLP with a few multi-megabyte layers trained with DDP for --steps optimizer steps, long
enough for bsrun's online adaptation to try its candidate configurations and keep one.

--opt sgd (momentum) / adam. Each rank saves its model, optimizer state, gradients and the
losses it saw to OUT-rankR.pt (exact_common.save_rank_state), so a test can compare a
scheduled run, switches included, with plain DDP on every rank.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from exact_common import save_rank_state, start

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.02, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01),
}
IN, WIDTH, CLASSES = 64, 1024, 10  # three 1024x1024 layers of 4.2 MB: several partitions at the default 4 MiB


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--opt", choices=OPTIMIZERS, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    rank, data = start()
    model = nn.Sequential(nn.Linear(IN, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                          nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                          nn.Linear(WIDTH, CLASSES))
    net = DDP(model)
    opt = OPTIMIZERS[a.opt](net.parameters())
    losses = []
    for _ in range(a.steps):
        x, y = torch.randn(16, IN, generator=data), torch.randint(0, CLASSES, (16,), generator=data)
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    save_rank_state(model, opt, f"{a.out}-rank{rank}.pt", losses=losses)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
