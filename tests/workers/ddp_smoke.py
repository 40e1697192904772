"""Three DDP steps: enough for the bootstrap, the scheduler and the run report."""
import torch
import torch.distributed as dist
import torch.nn as nn

dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
dist.destroy_process_group()
