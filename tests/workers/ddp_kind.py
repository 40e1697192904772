"""Reports which DDP class the script got and trains a few steps.

--find-unused builds DDP(find_unused_parameters=True); --skip-unused adds
skip_all_reduce_unused_params=True (which bsrun leaves to plain DDP); --no-ddp trains without DDP.
"""
import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

out = sys.argv[1]
dist.init_process_group("gloo")
net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
if "--no-ddp" in sys.argv:
    model = net
else:
    skip = "--skip-unused" in sys.argv
    model = DistributedDataParallel(net, find_unused_parameters="--find-unused" in sys.argv or skip,
                                    skip_all_reduce_unused_params=skip)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
if dist.get_rank() == 0:
    json.dump({"class": f"{type(model).__module__}.{type(model).__qualname__}",
               "is_ddp": isinstance(model, DistributedDataParallel)}, open(out, "w"))
dist.destroy_process_group()
