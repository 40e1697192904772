"""A Lightning script as users write it, for tests/test_frameworks.py: a small MLP
LightningModule on a synthetic TensorDataset, `Trainer(accelerator="cpu", devices=2,
strategy="ddp")`, deterministic, no logger, no checkpoints, no progress bar.

Run as `python fw_lightning.py ...` Lightning's own subprocess launcher starts rank 1 by
re-running this script (LOCAL_RANK=1); under `torchrun --nproc-per-node 2` Lightning finds
torchrun's variables and launches nothing.

--manual: manual optimisation (automatic_optimization=False, self.optimizers(),
self.manual_backward(loss), opt.step()); otherwise Lightning's automatic optimisation
(optimizer.step(closure) with the training step and backward inside the closure).
--accumulate N: Trainer(accumulate_grad_batches=N) (automatic only: Lightning runs the
first N-1 micro-batches under DDP's no_sync()).
--width: the MLP's hidden width (the profile test uses a wider one).
Rank 0 saves the final state_dict to --out."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl


class MLP(pl.LightningModule):
    def __init__(self, manual: bool, width: int):
        super().__init__()
        self.automatic_optimization = not manual
        self.net = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--manual", action="store_true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--width", type=int, default=64, help="hidden width of the MLP")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(128, 16, generator=g), torch.randint(0, 4, (128,), generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=False, num_workers=0)
    model = MLP(a.manual, a.width)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=a.steps, max_epochs=-1,
                         accumulate_grad_batches=a.accumulate, deterministic=True, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(model, loader)
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, a.out)


if __name__ == "__main__":
    main()
