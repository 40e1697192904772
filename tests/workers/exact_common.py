"""What the exactness workers share: one thread, the gloo group, the same initial model on
every rank (seed 0, drawn after the group is up) and each rank's own data stream; and the
group's clean end, for the scripts whose run without bsrun is the reference (a torch
teardown race would otherwise now and then abort or hang that run)."""

import time

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


def end_process_group() -> None:
    """Destroy the default group once every rank is done. Gloo's worker threads drop a
    finished collective's tensors after the caller has moved on, and that needs the GIL: if
    the group is destroyed first (at the interpreter's exit, or when the DDP model is freed)
    the process aborts ("terminate called without an active exception",
    pytorch/pytorch#190489; seen in CI in a run without bsrun) or deadlocks (the group's
    destructor joins a thread that waits for the GIL). So: a barrier, a pause without the
    GIL for those threads, then the destroy."""
    dist.barrier()
    time.sleep(0.2)
    dist.destroy_process_group()
