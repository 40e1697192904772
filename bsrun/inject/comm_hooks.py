"""DDP communication hooks run on bsrun's partitions: one GradBucket-like object per partition.

`register_comm_hook(state, hook)` on a scheduled model gives the hook to the torch
transport (bsrun/sched/torch_backend.py) as its `reduce`: the scheduler's control thread
calls the hook on each partition, in the agreed priority order, in place of bsrun's
all-reduce; the finisher waits for the future the hook returns and copies its value into
the gradients. As with DDP, the bucket holds the local gradients not yet divided by the
world size, and the hook averages.

Which process group. The hook's collectives run on bsrun's comm thread while the
training thread may use the DDP's process group (a metric all-reduce, a barrier), so they
would interleave differently on each rank. The hook therefore gets bsrun's data group
(the same ranks) in place of the DDP's group: for the default hooks the state *is* the
group (or None, the default group); for PowerSGD, `state.process_group` points at the
data group for the duration of each call. A hook whose state names any other group, or a
hook bsrun does not know (it could use any group, from any thread), keeps the real DDP.

Known hooks: default_hooks' allreduce_hook, fp16_compress_hook, bf16_compress_hook and
their fp16/bf16 wrappers, debugging_hooks.noop_hook, and powerSGD_hook with a
PowerSGDState (not batched_powerSGD_hook: it resizes the bucket's buffer, which bsrun's
zero-copy slices cannot allow, and torch 2.13's fails on the CPU anyway). PowerSGD issues further collectives from its
future's callbacks, so its partitions run one at a time (each future is done before the
next partition's hook is called), which keeps every rank's collectives in one order. Its
random start (`torch.manual_seed` + `torch.randn`, which would reseed the process-wide
generator from the comm thread under the training thread's feet) draws from a generator
of its own with the same seeds, so the values are DDP's and the script's random stream is
untouched.

Buckets: `index()` is the partition id (stable, so PowerSGD's per-bucket error and
warm-start memories stay with their partition), `is_last()` is true for the round's last
partition posted (PowerSGD counts iterations by it), `gradients()` are views of the
buffer in each parameter's shape. A tensor bsrun cuts across partitions appears as its
piece: rows of it when the cut falls between rows, else a flat slice (PowerSGD sends such
a slice uncompressed; `--partition` above the largest tensor keeps every tensor whole).
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

_GROUP_HOOKS = (default_hooks.allreduce_hook, default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook)
_POWERSGD_HOOKS = (powersgd.powerSGD_hook,)
_WRAPPERS = {default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook).__code__: default_hooks.fp16_compress_wrapper,
             default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook).__code__: default_hooks.bf16_compress_wrapper}


class Bucket:
    """What a DDP comm hook calls on `dist.GradBucket` (which has no Python constructor)."""

    def __init__(self, index: int, buffer: torch.Tensor, last: bool, params: list, grads: list):
        self._index, self._buffer, self._last = index, buffer, last
        self._params, self._grads = params, grads

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def is_last(self) -> bool:
        return self._last

    def gradients(self) -> list[torch.Tensor]:
        return list(self._grads)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)


def _inner(hook):
    """(wrapper factory, wrapped hook) for default_hooks' fp16/bf16 wrappers, else None."""
    factory = _WRAPPERS.get(getattr(hook, "__code__", None))
    if factory is None:
        return None
    cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or ()))
    return factory, cells["hook"].cell_contents


def _base(hook):
    """The hook a chain of wrappers ends in."""
    while (unwrapped := _inner(hook)) is not None:
        hook = unwrapped[1]
    return hook


def _is_ddp_group(group, ddp_group) -> bool:
    default = dist.distributed_c10d._get_default_group()
    return (default if group is None else group) is ddp_group


def why_not_scheduled(hook, hook_state, ddp_group) -> str | None:
    """Why bsrun cannot run this hook on its partitions (the model keeps the real DDP), or None."""
    base = _base(hook)
    name = getattr(hook, "__qualname__", type(hook).__name__)
    if base is debugging_hooks.noop_hook:
        return None
    if any(base is h for h in _GROUP_HOOKS):
        if hook_state is not None and not isinstance(hook_state, dist.ProcessGroup):
            return f"the DDP comm hook {name} with a state of type {type(hook_state).__name__}"
        return None if _is_ddp_group(hook_state, ddp_group) else \
            f"the DDP comm hook {name} on a process group other than the model's"
    if any(base is h for h in _POWERSGD_HOOKS):
        if not isinstance(hook_state, powersgd.PowerSGDState):
            return f"the DDP comm hook {name} with a state of type {type(hook_state).__name__}"
        return None if _is_ddp_group(hook_state.process_group, ddp_group) else \
            f"the DDP comm hook {name} on a process group other than the model's"
    return f"a DDP comm hook bsrun does not know: {name}"


class _OwnRandom:
    """`torch` for PowerSGD's code: its seeding and drawing use a generator of its own."""

    def __init__(self):
        self._generator = torch.Generator()
        self.random = types.SimpleNamespace(fork_rng=lambda *args, **kwargs: contextlib.nullcontext())

    def manual_seed(self, seed):
        return self._generator.manual_seed(seed)

    def randn(self, *size, **kwargs):
        if kwargs.get("device", "cpu") not in ("cpu", torch.device("cpu")):
            raise RuntimeError("bsrun runs PowerSGD on the CPU only")
        return torch.randn(*size, generator=self._generator, **kwargs)

    def __getattr__(self, name):
        return getattr(torch, name)


def _with_own_random(fn):
    """The same function, reading `torch` from a copy of its globals with _OwnRandom."""
    scope = dict(fn.__globals__)
    scope["torch"] = _OwnRandom()
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    return copy


def _rebuilt(hook):
    """The hook with PowerSGD's random start made private (wrappers rebuilt around it)."""
    unwrapped = _inner(hook)
    if unwrapped is not None:
        factory, inner = unwrapped
        return factory(_rebuilt(inner))
    return _with_own_random(hook) if any(hook is h for h in _POWERSGD_HOOKS) else hook


class ScheduledHook:
    """The torch transport's `reduce`: the user's hook on one partition (see the docstring)."""

    def __init__(self, hook, hook_state, params: list[torch.Tensor]):
        self.name = getattr(hook, "__qualname__", type(hook).__name__)
        self.state = hook_state
        self.powersgd = any(_base(hook) is h for h in _POWERSGD_HOOKS)
        self.hook = _rebuilt(hook) if self.powersgd else hook
        self.params = params

    def _bucket(self, part, data: torch.Tensor, last: bool) -> Bucket:
        params, grads, offset = [], [], 0
        for pc in part.pieces:
            param, n = self.params[pc.tensor], pc.stop - pc.start
            flat = data[offset:offset + n]
            offset += n
            row = param.numel() // param.shape[0] if param.dim() > 1 and param.shape[0] else 0
            if n == param.numel():
                flat = flat.view(param.shape)
            elif row and pc.start % row == 0 and n % row == 0:
                flat = flat.view(n // row, *param.shape[1:])
            params.append(param)
            grads.append(flat)
        return Bucket(part.pid, data, last, params, grads)

    def __call__(self, part, data: torch.Tensor, group, last: bool) -> torch.futures.Future:
        bucket = self._bucket(part, data, last)
        if not self.powersgd:
            return self.hook(group if isinstance(self.state, (dist.ProcessGroup, type(None))) else self.state,
                             bucket)
        own = self.state.process_group
        self.state.process_group = group
        try:
            future = self.hook(self.state, bucket)
        finally:
            self.state.process_group = own
        future.wait()  # its callbacks issue collectives: one partition at a time keeps their order
        return future
