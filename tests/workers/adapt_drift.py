"""A communication-bound DDP job whose step the test outside can follow and end.

Light compute (a batch of 8 through a 512-wide MLP), 2.1 MB of gradients per step: on an
emulated 1 Gbit/s link each step is mostly the all-reduce, at 50 Mbit/s almost entirely.

After every optimizer step rank 0 writes --status (atomically, JSON): the step number
(1 = the first step, as bsrun counts them) and, when bsrun schedules this process, the
`adapt` part of its own report as it stands (None if bsrun has none), so the test can act
once the first exploration settled. Before each step every rank looks for the --stop file
and the ranks agree (a MAX all-reduce) so that all of them stop at the same step; --steps
is only the upper bound.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from exact_common import start

WIDTH = 512


def adapt_now():
    """This rank's adaptation as its run report would show it now, or None."""
    try:
        from bsrun.inject import state
        return state.counters().get("adapt")
    except Exception:  # not under bsrun, or a bsrun without adaptation
        return None


def write_status(path: str, step: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"step": step, "adapt": adapt_now()}, f)
    os.replace(tmp, path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400, help="at most this many steps")
    p.add_argument("--status", required=True)
    p.add_argument("--stop", required=True)
    a = p.parse_args()

    rank, data = start()
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                          nn.Linear(WIDTH, 10))
    net = DDP(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    stop = torch.zeros(1)
    for step in range(1, a.steps + 1):
        stop.fill_(float(os.path.exists(a.stop)))
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            break
        x, y = torch.randn(8, WIDTH, generator=data), torch.randint(0, 10, (8,), generator=data)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        if rank == 0:
            write_status(a.status, step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
