"""Three DDP steps: enough for the bootstrap, the scheduler and the run report.
COUNT_GLOO_LOOPS=1: then each rank prints how many gloo event loop threads it runs.
NO_GLOO_OPTIONS=1: first as a torch without gloo's private device options."""
import glob
import os

import torch
import torch.distributed as dist
import torch.nn as nn

if os.environ.get("NO_GLOO_OPTIONS") == "1":
    del dist.ProcessGroupGloo._Options
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
if os.environ.get("COUNT_GLOO_LOOPS") == "1":
    names = [open(path).read().strip() for path in glob.glob("/proc/self/task/*/comm")]
    print(f"rank {dist.get_rank()}: {names.count('gloo_tcp_loop')} gloo event loops", flush=True)
dist.destroy_process_group()
