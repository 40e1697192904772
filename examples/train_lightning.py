"""An ordinary PyTorch Lightning script: a VGG-11-style network on synthetic CIFAR-sized data.

Automatic optimisation (Lightning passes a closure to `optimizer.step`), DDP strategy.
Runs unmodified with Lightning's own launcher, under torchrun and under bsrun:
    python examples/train_lightning.py                       # Lightning starts rank 1 itself
    bsrun python examples/train_lightning.py                 # the same, scheduled
    bsrun -np 2 python examples/train_lightning.py           # bsrun starts both ranks
`--times FILE` writes rank 0's time between consecutive step ends (after `--warmup`
steps) for scripts/bench_lightning.py.
"""

import argparse
import json
import time

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

VGG11_CONVS = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


class VGG11(L.LightningModule):
    """Convolutions, then a large fully connected classifier: the layers the next forward
    needs first are the last ones whose gradients are ready, where scheduling pays."""

    def __init__(self, hidden: int = 4096, lr: float = 0.01):
        super().__init__()
        layers, channels = [], 3
        for v in VGG11_CONVS:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(channels, v, 3, padding=1), nn.ReLU(inplace=True)]
                channels = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(512, hidden), nn.ReLU(inplace=True),
                                        nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
                                        nn.Linear(hidden, 10))
        self.lr = lr

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))

    def training_step(self, batch, _index):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class StepTimes(L.Callback):
    """Rank 0's wall time between consecutive training step ends."""

    def __init__(self, warmup: int):
        self.warmup, self.ends = warmup, []

    def on_train_batch_end(self, trainer, *_args):
        if trainer.global_rank == 0:
            self.ends.append(time.perf_counter())

    def times(self) -> list[float]:
        ends = self.ends[self.warmup:]
        return [b - a for a, b in zip(ends, ends[1:])]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="steps not timed")
    parser.add_argument("--batch", type=int, default=64, help="per-worker batch size")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--times", default=None, help="write rank 0's step times (JSON) here")
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    n = args.batch * args.steps * args.devices
    data = TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
    timer = StepTimes(args.warmup)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp", max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer])
    trainer.fit(VGG11(), DataLoader(data, batch_size=args.batch))
    if args.times and trainer.global_rank == 0:
        with open(args.times, "w") as f:
            json.dump(timer.times(), f)


if __name__ == "__main__":
    main()
