"""bf16 autocast + GradScaler on CPU, as users write it: `scaler.scale(loss).backward()`,
optionally `scaler.unscale_(opt)` + `clip_grad_norm_`, `scaler.step(opt)`, `scaler.update()`.

--inf-step N makes rank 1's loss (and so its gradients) inf at step N: that step must be
skipped on every rank and the scale halved. --scaler cuda uses the `torch.cuda.amp`
spelling (it disables itself without CUDA). --bucket-cap-mb passes DDP's bucket size (to
measure how much plain DDP itself moves with another bucket layout).

Rank 0 saves model, optimizer and scaler state to --out; every rank writes the scale after
each step to --out.scales-rankR.json."""

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from exact_common import mlp, start


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--no-unscale", action="store_true", help="no unscale_ and no clipping")
    p.add_argument("--inf-step", type=int, default=-1)
    p.add_argument("--scaler", choices=("amp", "cuda"), default="amp")
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    rank, data = start()
    model = mlp(64, 5)
    kwargs = {} if a.bucket_cap_mb is None else {"bucket_cap_mb": a.bucket_cap_mb}
    net = DDP(model, **kwargs)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    if a.scaler == "amp":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    else:
        scaler = torch.cuda.amp.GradScaler(init_scale=2.0 ** 10)
    scales = []
    for step in range(a.steps):
        opt.zero_grad()
        x, y = torch.randn(32, 64, generator=data), torch.randint(0, 10, (32,), generator=data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(x), y)
        if step == a.inf_step and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if not a.no_unscale:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    with open(f"{a.out}.scales-rank{rank}.json", "w") as f:
        json.dump({"enabled": scaler.is_enabled(), "scales": scales}, f)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scaler": scaler.state_dict()}, a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
