"""A tiny DDP job for `bsrun tune` tests (20 steps unless told otherwise).

    --fail-trial N   in trial N (BSRUN_TRIAL_ID), rank 1 raises after its first step
    --hang-trial N   in trial N, rank 0 sleeps for ever after its first step
    --pid-dir DIR    each rank records its pid there (pid-<trial>-<rank>)
    --sleep S        sleep S seconds in every step (so that a kill lands mid-trial)
    --steps N        optimizer steps the job runs on its own (a trial may end it sooner)
    --short-trial N  in trial N, the job runs only 2 steps
"""
import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--fail-trial", type=int, default=-1)
p.add_argument("--hang-trial", type=int, default=-1)
p.add_argument("--pid-dir", type=Path, default=None)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--short-trial", type=int, default=-1)
a = p.parse_args()
trial, rank = int(os.environ.get("BSRUN_TRIAL_ID", "0")), int(os.environ["RANK"])
if a.pid_dir is not None:
    (a.pid_dir / f"pid-{trial}-{rank}").write_text(str(os.getpid()))

dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256),
                                                          nn.ReLU(), nn.Linear(256, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
try:
    for step in range(2 if trial == a.short_trial else a.steps):
        opt.zero_grad()
        model(torch.randn(8, 32)).sum().backward()
        opt.step()
        if step == 0 and trial == a.fail_trial and rank == 1:
            raise RuntimeError(f"injected failure in trial {trial}")
        if step == 0 and trial == a.hang_trial and rank == 0:
            time.sleep(3600)
        time.sleep(a.sleep)
finally:
    dist.destroy_process_group()
