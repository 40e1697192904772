"""Unsettled parameters: a script's first read of a parameter bsrun still owes settles it.

bsrun leaves work in flight after `backward()` (the gradient's communication) and after
`step()` (an update still pending), and the dependency proxy settles a parameter when
its own module's forward needs it. Any other reader (manual clipping, GradScaler's
unscale_, gradient logging, an EMA of the weights, a weight norm, a validation forward
through another module) must see what plain DDP would show it. So while a parameter is
owed something, its class is swapped for a twin with a live `__torch_function__`
(`trap`), and swapped back once it is settled (`release`):

- gradient in flight: reading or setting `.grad` waits for that parameter's own
  partitions; reading its value passes (the value does not change until the update);
- update or zero_grad pending: any use but metadata (shape, dtype, ...) applies them.

Why this is complete for Python code: every access to a tensor's data or gradient goes
through an op's argument parser (TensorList elements included), a getset descriptor
(`grad`, `data`) or pickling/copying, and all three consult `__torch_function__` of a
subclass. The autograd engine's own accumulation is C++ and never does, so the backward
pays nothing; a settled parameter is a plain `nn.Parameter` again, whose disabled
`__torch_function__` C++ skips without a call, so code that reads nothing keeps the full
overlap. What can escape (docs/ARCHITECTURE.md, "Exactness"): aliases taken before the
parameter was trapped (`w = p.data` kept from earlier), C++ holders (TorchScript,
extensions), reads from other threads. bsrun's own code runs under `internal()` and is
never trapped.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

_GRAD = torch._C.TensorBase.grad
_METADATA = {getattr(torch._C.TensorBase, name) for name in (
    "requires_grad", "shape", "dtype", "device", "is_leaf", "ndim", "layout", "is_sparse", "is_cpu",
    "is_cuda", "grad_fn", "is_meta", "is_quantized", "names", "is_nested")
    if hasattr(torch._C.TensorBase, name)}
_METADATA_FUNCTIONS = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size,
                       torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.__repr__}


class Owner(Protocol):
    """What a trapped parameter's model must answer (ModelRuntime)."""

    def owes_update(self, index: int) -> bool:
        """An update or a zero_grad of this parameter is pending."""

    def settle(self, indices: list[int]) -> None:
        """Communication done, update and zero applied; releases what became final."""


_OWNERS: dict[int, tuple[Owner, int]] = {}  # id(trapped tensor) -> (its model, its index there)


def _settle_what_is_read(func, args, kwargs) -> None:
    descriptor = getattr(func, "__self__", None)
    if descriptor in _METADATA or func in _METADATA_FUNCTIONS:
        return
    for value in (*args, *kwargs.values()):
        for tensor in (value if isinstance(value, (list, tuple)) else (value,)):
            if type(tensor) in _TRAPS:
                entry = _OWNERS.get(id(tensor))
                if entry is not None:
                    owner, index = entry
                    if descriptor is _GRAD or owner.owes_update(index):
                        owner.settle([index])


def _torch_function(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    with torch._C.DisableTorchFunctionSubclass():
        _settle_what_is_read(func, args, kwargs)
        return func(*args, **kwargs)


def _deepcopy(self, memo):
    """nn.Parameter's deepcopy builds `type(self)(...)`: settle first, so that the copy is
    of the settled value and of the plain class."""
    entry = _OWNERS.get(id(self))
    if entry is not None:
        entry[0].settle([entry[1]])
    release(self)
    return self.__deepcopy__(memo)


class UnsettledParameter(torch.nn.Parameter):
    __torch_function__ = classmethod(_torch_function)
    __deepcopy__ = _deepcopy


class UnsettledTensor(torch.Tensor):  # Horovod takes plain leaf tensors too
    __torch_function__ = classmethod(_torch_function)
    __deepcopy__ = _deepcopy


_TRAPS = {UnsettledParameter: torch.nn.Parameter, UnsettledTensor: torch.Tensor}
_TRAP_OF = {plain: trap for trap, plain in _TRAPS.items()}


def trappable(tensor: torch.Tensor) -> bool:
    """Only a tensor of exactly nn.Parameter or Tensor: another subclass keeps its own class."""
    return type(tensor) in _TRAP_OF or type(tensor) in _TRAPS


def trap(tensor: torch.Tensor, owner: Owner, index: int) -> None:
    if type(tensor) in _TRAP_OF:
        _OWNERS[id(tensor)] = (owner, index)
        tensor.__class__ = _TRAP_OF[type(tensor)]


def release(tensor: torch.Tensor) -> None:
    plain = _TRAPS.get(type(tensor))
    if plain is not None:
        tensor.__class__ = plain
        _OWNERS.pop(id(tensor), None)


def is_trapped(tensor: torch.Tensor) -> bool:
    return type(tensor) in _TRAPS


def internal(method):
    """bsrun's own code reads and writes parameters without tripping their traps."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with torch._C.DisableTorchFunctionSubclass():
            return method(*args, **kwargs)
    return wrapper
