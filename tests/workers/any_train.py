"""A torchrun script (env:// rendezvous): DDP on the MLP, a few steps; rank 0 saves the state_dict to --out."""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import any_common  # noqa: E402
from exact_common import end_process_group  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
a = p.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(any_common.make_model())
any_common.train(model, rank)
if rank == 0:
    any_common.save(model.module, a.out)
end_process_group()
