"""Reads a weight right after every step, the way logging code does.

With --synchronize it calls bsrun.synchronize() first (when bsrun is there), which must
make the read see the updated weights.
"""
import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

out, synchronize = sys.argv[1], "--synchronize" in sys.argv
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
data = torch.Generator().manual_seed(dist.get_rank())
seen = []
for _ in range(6):
    opt.zero_grad()
    model(torch.randn(8, 16, generator=data)).pow(2).mean().backward()
    opt.step()
    if synchronize:
        try:
            import bsrun
            bsrun.synchronize()
        except ImportError:
            pass
    seen.append(model.module[0].weight.sum().item())
if dist.get_rank() == 0:
    json.dump(seen, open(out, "w"))
dist.destroy_process_group()
