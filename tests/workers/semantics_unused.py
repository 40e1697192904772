"""DDP(find_unused_parameters=True) with parameters unused on some ranks and on all of them.

`branch` runs on rank 0 only; `side` only in the first micro-batch of an accumulating step
(under no_sync) on rank 1; `dead` never runs, and at --manual-step its weight is given a
.grad of the script's own, different on each rank (DDP leaves a parameter unused on every
rank untouched, so Adam steps it with that rank's own gradient). Adam with weight decay.
--static-graph: DDP(static_graph=True) instead, whose reducer finds the unused parameters
in its first iteration and treats them the same way (no no_sync step then).
Each rank saves its model, its optimizer state, its gradients and which are None to
OUT-rankR.pt."""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from exact_common import save_rank_state, start


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.branch = nn.Linear(32, 32)
        self.side = nn.Linear(32, 32)
        self.dead = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x, branch, side=False):
        h = torch.tanh(self.trunk(x))
        if branch:
            h = h + torch.tanh(self.branch(h))
        if side:
            h = h + self.side(h)
        return self.head(h)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--accumulate-step", type=int, default=3)
    p.add_argument("--keep-step", type=int, default=5, help="zero_grad(set_to_none=False) at this step")
    p.add_argument("--manual-step", type=int, default=6)
    p.add_argument("--static-graph", action="store_true")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    rank, data = start()
    model = Net()
    net = DDP(model, static_graph=True) if a.static_graph else DDP(model, find_unused_parameters=True)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []

    def batch():
        return torch.randn(8, 16, generator=data), torch.randint(0, 10, (8,), generator=data)

    for step in range(a.steps):
        opt.zero_grad(set_to_none=step != a.keep_step)
        if step == a.manual_step:
            model.dead.weight.grad = torch.full_like(model.dead.weight, 0.01 * (rank + 1))
        if step == a.accumulate_step:
            x, y = batch()
            with net.no_sync():
                F.cross_entropy(net(x, rank == 0, side=rank == 1), y).backward()
        x, y = batch()
        loss = F.cross_entropy(net(x, rank == 0), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    save_rank_state(model, opt, f"{a.out}-rank{rank}.pt", losses=losses)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
