"""An Accelerate training loop: Accelerator(cpu=True), prepare(model, optimizer, dataloader),
accelerator.backward, step, zero_grad; the MLP on a synthetic TensorDataset. Launched by
`accelerate launch --multi_gpu --num_processes 2 ...` (without a GPU that is MULTI_CPU over
gloo, through torch.distributed.run; `--cpu --num_processes 2` starts one process). Rank 0
saves the unwrapped model's state_dict to --out."""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import any_common  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
a = p.parse_args()
torch.set_num_threads(1)
accelerator = Accelerator(cpu=True)
assert accelerator.num_processes == 2, f"expected 2 processes, got {accelerator.num_processes}"
model = any_common.make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(7)
data = TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
model, opt, loader = accelerator.prepare(model, opt, DataLoader(data, batch_size=8, shuffle=False))
for x, y in loader:
    accelerator.backward(F.cross_entropy(model(x), y))
    opt.step()
    opt.zero_grad()
accelerator.wait_for_everyone()
if accelerator.is_main_process:
    any_common.save(accelerator.unwrap_model(model), a.out)
accelerator.end_training()
