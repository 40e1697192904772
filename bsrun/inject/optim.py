"""Stepping the user's own optimizer for a subset of its parameters.

The updates are done by the optimizer the script built, narrowed for one call to the
parameters whose communication is complete (its `param_groups` swapped for copies that
hold only those parameters, with the hyperparameters as they were when the script
called `step()`), then restored. State stays keyed by the parameter, so `state_dict()`,
LR schedulers and checkpoints keep working. This is only right for optimizers whose
update of one parameter depends on that parameter alone: the allow-list below.
"""

from __future__ import annotations

import time

import torch

from bsrun.inject import state

ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "Adadelta",
    "Rprop", "ASGD") if hasattr(torch.optim, name))


def snapshot_groups(optimizer) -> list[dict]:
    """Hyperparameters of every group now; tensors cloned (schedulers may fill_ them)."""
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v)
             for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def unhooked_step(optimizer):
    """The class's step without torch's hook wrapper, so user step hooks don't run per call."""
    step = type(optimizer).step
    return getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step


def full_step(optimizer, closure=None):
    """The optimizer's own step over all its parameters, hooks included."""
    step = type(optimizer).step
    return step(optimizer) if closure is None else step(optimizer, closure)


def why_not_elementwise(optimizer) -> str | None:
    """A reason this step needs every gradient at once, or None if per-parameter is exact.
    A closure is no reason: an elementwise optimizer runs it first and then updates each
    parameter from its own gradient alone (only the closure's loss is returned); a
    non-elementwise one (LBFGS) may call it again and reads every gradient between calls."""
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return "GradScaler's step of a fused optimizer"  # a subset stepped later would miss them
    if type(optimizer) not in ELEMENTWISE:
        return f"{type(optimizer).__name__} is not a known elementwise optimizer"
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return "optimizer step hooks"
    from torch.optim import optimizer as optimizer_module

    if optimizer_module._global_optimizer_pre_hooks or optimizer_module._global_optimizer_post_hooks:
        return "global optimizer step hooks"
    return None


def step_subset(optimizer, snapshot: list[dict], items: list[tuple[int, torch.nn.Parameter]]) -> None:
    """One narrowed step over (group index, parameter) pairs, with the snapshot's values;
    timed for the profile recorder when one records."""
    if not items:
        return
    recorder = state.recorder
    began = time.perf_counter_ns() if recorder is not None else 0
    by_group: dict[int, list] = {}
    for group_index, param in items:
        by_group.setdefault(group_index, []).append(param)
    saved = optimizer.param_groups
    optimizer.param_groups = [dict(snapshot[g], params=ps) for g, ps in by_group.items()]
    try:
        unhooked_step(optimizer)(optimizer)
    finally:
        optimizer.param_groups = saved
    if recorder is not None:
        recorder.updated([p for _, p in items], began)


def zero_param_grad(param, set_to_none: bool) -> None:
    """What Optimizer.zero_grad does to one parameter."""
    if param.grad is None:
        return
    if set_to_none:
        param.grad = None
        return
    if param.grad.grad_fn is not None:
        param.grad.detach_()
    else:
        param.grad.requires_grad_(False)
    param.grad.zero_()
