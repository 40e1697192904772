"""What every any_* worker trains: a small MLP, SGD with momentum, a few synthetic batches per rank."""

import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def batches(rank: int, steps: int = STEPS):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(steps)]


def train(model: nn.Module, rank: int) -> None:
    """STEPS steps of `model` (a DDP model) on this rank's batches."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches(rank):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def save(model: nn.Module, out: str) -> None:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)
