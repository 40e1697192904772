"""An Accelerate training loop as users write it, for tests/test_frameworks.py:
`Accelerator(cpu=True, gradient_accumulation_steps=2)`, prepare(model, optimizer,
dataloader), `with accelerator.accumulate(model):` (DDP's no_sync() on the first
micro-batch of each step), accelerator.backward(loss), optimizer.step(), zero_grad(), a
small MLP on a synthetic TensorDataset, AdamW, a few steps.

Launched by `accelerate launch --multi_gpu --num_processes 2 ...` (on a machine without a
GPU Accelerate then runs MULTI_CPU over gloo; `--cpu --num_processes 2` would start one
process without mpirun). Rank 0 saves the unwrapped model's state_dict to --out."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    assert accelerator.num_processes == 2, f"expected 2 processes, got {accelerator.num_processes}"
    set_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(128, 16, generator=g), torch.randint(0, 4, (128,), generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=False)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    micro = 0
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        micro += 1
        if micro == 2 * a.steps:
            break
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state = accelerator.unwrap_model(model).state_dict()
        torch.save({k: v.detach().clone() for k, v in state.items()}, a.out)
    accelerator.end_training()


if __name__ == "__main__":
    main()
