"""Install bsrun into torch: the few entry points through which scripts reach gradients.

DDP's constructor builds a ScheduledDDP; every optimizer's `step()` goes to the runtime
of the model that owns its parameters; and everything that reads parameters or
gradients outside the scheduled path (state_dict, torch.save, gradient clipping,
zero_grad, destroy_process_group, interpreter exit) first waits for the scheduled work;
process groups get bsrun's --timeout unless the script sets one.
With scheduling off (BSRUN_ENABLE=0) nothing is patched: DDP stays exactly as it is.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from bsrun.inject import compiled, optim, state


def _flushing(fn, note=None):
    """Wrap fn so that scheduled work is finished before it runs."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if state.MODELS:
            if note:
                state.say_once(note)
            state.flush_all()
        return fn(*args, **kwargs)
    return wrapper


def _scheduled_step(optimizer, closure=None):
    """Instance-level step(): LR schedulers wrap it as they wrap any bound step."""
    return _step(optimizer, closure)


def _step(optimizer, closure):
    number = state.count_step()
    rt = state.model_of(p for g in optimizer.param_groups for p in g["params"])
    result = optim.full_step(optimizer, closure) if rt is None else rt.optimizer_step(optimizer, closure, number)
    state.step_finished(number)
    return result


def _patch_optimizer() -> None:
    Optimizer = torch.optim.Optimizer
    original_init = Optimizer.__init__
    original_zero_grad = Optimizer.zero_grad

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.step = _scheduled_step.__get__(self, type(self))

    @functools.wraps(original_zero_grad)
    def zero_grad(self, set_to_none: bool = True):
        params = [p for g in self.param_groups for p in g["params"]]
        rt = state.model_of(params)
        if rt is None:
            return original_zero_grad(self, set_to_none)
        rt.zero_grad(params, set_to_none)

    Optimizer.__init__ = __init__
    Optimizer.zero_grad = zero_grad
    Optimizer.state_dict = _flushing(Optimizer.state_dict)
    Optimizer.load_state_dict = _flushing(Optimizer.load_state_dict)


def _patch_module_zero_grad() -> None:
    original = torch.nn.Module.zero_grad

    @functools.wraps(original)
    def zero_grad(self, set_to_none: bool = True):
        rt = state.model_of(self.parameters()) if state.MODELS else None
        if rt is None:
            return original(self, set_to_none)
        rt.zero_grad(list(self.parameters()), set_to_none)

    torch.nn.Module.zero_grad = zero_grad


def _patch_flush_points() -> None:
    torch.save = _flushing(torch.save)
    clip = torch.nn.utils.clip_grad
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        wrapped = _flushing(getattr(clip, name),
                            note=f"{name} needs all gradients at once: synchronising fully at those steps")
        setattr(clip, name, wrapped)
        setattr(torch.nn.utils, name, wrapped)
    original_destroy = dist.destroy_process_group

    @functools.wraps(original_destroy)
    def destroy_process_group(*args, **kwargs):
        state.flush_all()
        state.close_all()
        return original_destroy(*args, **kwargs)

    dist.destroy_process_group = destroy_process_group


def _patch_default_timeout(seconds: float) -> None:
    """bsrun's --timeout for process groups the script creates without a timeout of its
    own, so a hung peer ends the job in minutes, not in torch's default half hour."""
    original = dist.init_process_group
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("timeout") is None:
            bound.arguments["timeout"] = timedelta(seconds=seconds)
        return original(*bound.args, **bound.kwargs)

    dist.init_process_group = init_process_group


def _communication_is_up() -> bool:
    hvd = sys.modules.get("horovod.torch")
    return dist.is_initialized() or (hvd is not None and hvd.is_initialized())


def _at_exit() -> None:
    """Whichever rank leaves first finishes its scheduled work first: its peers' comm
    threads post the same rounds, so this needs no barrier (docs/ARCHITECTURE.md, "Exit")."""
    try:
        if _communication_is_up():
            state.flush_all()
    finally:
        state.close_all()
    state.note_if_nothing_scheduled()


def install() -> None:
    """Called by the bootstrap once torch is imported, only with scheduling on."""
    from bsrun.inject.ddp import ScheduledDDP

    torch.nn.parallel.distributed.DistributedDataParallel = ScheduledDDP
    torch.nn.parallel.DistributedDataParallel = ScheduledDDP
    _patch_optimizer()
    _patch_module_zero_grad()
    _patch_flush_points()
    _patch_default_timeout(state.config().timeout)
    compiled.install()
    compiled.keep_eager(sys.modules[__name__], "_step")
    compiled.keep_eager(torch.optim.Optimizer, "zero_grad")
    compiled.keep_eager(torch.nn.Module, "zero_grad")
    atexit.register(_at_exit)
