"""optimizer.step(closure), as Lightning's automatic optimisation calls it: the closure
zeroes the gradients, runs the forward and the backward and returns the loss.

--opt sgd (momentum) / adam / lbfgs. Rank 0 saves its model, optimizer state, gradients
and the losses step() returned to OUT-rank0.pt (and rank 1 to OUT-rank1.pt). Under bsrun
it also records, after each step(), how many parameters were left with their update
pending (the overlap with the next forward); 0 under plain DDP."""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from exact_common import mlp, save_rank_state, start


def pending_updates() -> int:
    """Parameters whose update bsrun left for the next forward (0 when bsrun schedules nothing)."""
    try:
        from bsrun.inject import state
    except ImportError:
        return 0
    return sum(len(model.pending) for model in list(state.MODELS))

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01),
    "lbfgs": lambda ps: torch.optim.LBFGS(ps, lr=0.1, max_iter=3),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--opt", choices=OPTIMIZERS, required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    rank, data = start()
    model = mlp(32, 3)
    net = DDP(model)
    opt = OPTIMIZERS[a.opt](net.parameters())
    losses, pending = [], []
    for _ in range(a.steps):
        x, y = torch.randn(16, 32, generator=data), torch.randint(0, 10, (16,), generator=data)

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            return loss

        losses.append(opt.step(closure).item())
        pending.append(pending_updates())
    save_rank_state(model, opt, f"{a.out}-rank{rank}.pt", losses=losses, pending=pending)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
