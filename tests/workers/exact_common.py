"""What the exactness workers share: one thread, the gloo group, the same initial model on
every rank (seed 0, drawn after the group is up) and each rank's own data stream."""

import torch
import torch.distributed as dist
import torch.nn as nn


def start(data_seed: int = 0) -> tuple[int, torch.Generator]:
    """(rank, this rank's data generator, seeded data_seed + rank)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    return rank, torch.Generator().manual_seed(data_seed + rank)


def mlp(width: int, depth: int, classes: int = 10) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)], nn.Linear(width, classes))


def save_rank_state(model: nn.Module, opt, path: str, **extra) -> None:
    """What the semantics tests compare: the model, the optimizer state, the gradients and
    which of them are None (DDP's unused-parameter rules), plus the worker's own `extra`."""
    grads = {name: (None if q.grad is None else q.grad.clone()) for name, q in model.named_parameters()}
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "grads": grads,
                "grad_is_none": {name: g is None for name, g in grads.items()}, **extra}, path)
