"""Ordinary DDP training code that reads gradients between backward() and step(), or
parameters between step() and the next forward, with no bsrun.synchronize() anywhere.

--reader clamp: `p.grad.clamp_(-c, c)` on every parameter between backward and step.
--reader ema:   an EMA model (swa_utils.AveragedModel, get_ema_multi_avg_fn) updated after
                every step.
--reader norm:  a weight norm logged after every step (the list is saved).
--reader none:  none of these (plain training, e.g. for the replica check).

Rank 0 saves the model, the optimizer, and the EMA's state or the norms, to --out."""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from exact_common import mlp, start
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reader", choices=("clamp", "ema", "norm", "none"), required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    rank, data = start()
    model = mlp(128, 6)
    net = DDP(model)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9)) if a.reader == "ema" else None
    norms = []
    for _ in range(a.steps):
        opt.zero_grad()
        x, y = torch.randn(32, 128, generator=data), torch.randint(0, 10, (32,), generator=data)
        F.cross_entropy(net(x), y).backward()
        if a.reader == "clamp":
            for param in model.parameters():
                param.grad.clamp_(-0.01, 0.01)
        opt.step()
        if ema is not None:
            ema.update_parameters(model)
        if a.reader == "norm":
            norms.append(torch.linalg.vector_norm(model[3].weight).item())
    if rank == 0:
        saved = {"model": model.state_dict(), "optimizer": opt.state_dict(), "norms": torch.tensor(norms)}
        if ema is not None:
            saved["ema"] = ema.state_dict()
        torch.save(saved, a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
