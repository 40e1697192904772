"""DDP with uneven inputs under Join: rank 0 has 5 batches, rank 1 has 3 (--batches 5,3).

--how context: `with Join([net]):`; --how method: `with net.join():`. A BatchNorm buffer
(broadcast before each forward, under Join from the highest rank not joined), SGD with
momentum. --find-unused adds a branch only rank 0 runs (find_unused_parameters=True).
--throw: join(throw_on_early_termination=True); each rank catches Join's RuntimeError and
saves what it says. --divide-by-active: join(divide_by_initial_world_size=False).
Each rank saves its model, optimizer state, gradients and which are None to OUT-rankR.pt."""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from exact_common import save_rank_state, start


class Net(nn.Module):
    def __init__(self, branch):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.norm = nn.BatchNorm1d(64)
        self.branch = nn.Linear(64, 64) if branch else None
        self.head = nn.Linear(64, 10)

    def forward(self, x, branch=False):
        h = torch.relu(self.norm(self.inp(x)))
        if branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--how", choices=("context", "method"), default="context")
    p.add_argument("--find-unused", action="store_true")
    p.add_argument("--throw", action="store_true")
    p.add_argument("--batches", default="5,3", help="rank 0's and rank 1's numbers of batches")
    p.add_argument("--divide-by-active", action="store_true")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    rank, data = start()
    model = Net(a.find_unused)
    net = DDP(model, find_unused_parameters=a.find_unused)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    batches = [(torch.randn(8, 16, generator=data), torch.randint(0, 10, (8,), generator=data))
               for _ in range(int(a.batches.split(",")[rank]))]
    losses, raised = [], None
    options = {"throw_on_early_termination": a.throw, "divide_by_initial_world_size": not a.divide_by_active}
    try:
        with (Join([net], **options) if a.how == "context" else net.join(**options)):
            for x, y in batches:
                opt.zero_grad()
                loss = F.cross_entropy(net(x, branch=a.find_unused and rank == 0), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
    except RuntimeError as e:
        if not a.throw:
            raise
        raised = "exhausted" in str(e)
    save_rank_state(model, opt, f"{a.out}-rank{rank}.pt", losses=losses, raised=raised)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
