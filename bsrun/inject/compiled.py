"""torch.compile: bsrun's code is never traced, and every compiled call starts settled.

What goes wrong otherwise (measured): dynamo inlines bsrun's forward pre-hook, breaks the
graph inside it, and compiles the code the hook runs, the user's optimizer step among it;
compiled Adam rounds differently from eager Adam, and which parameters got which depends
on each rank's timing, so the replicas drift apart. So:

- every compiled callable that `torch.compile` returns (a compiled function, an
  `OptimizedModule`'s forward, `Module.compile()`'s call) first finishes the scheduled
  communication and applies every pending update (said once), so compiled code only
  ever sees settled parameters, exactly as plain DDP's;
- bsrun's hooks return at once while dynamo traces (`tracing()`), and its entry points
  that compiled code may call (registered with `keep_eager`) are `torch.compiler.disable`d
  at the first compile (not before: that would import dynamo into every worker), so no
  bsrun code ends up in a graph or gets compiled;
- inside a compiled call (a whole training step compiled, backward and step included)
  each backward pass ends settled and each step is a full one (`inside_compiled_call`).

The overlap kept: the backward pass's, for every eager backward (the usual case, where
only the model is compiled); lost: the next forward's per-layer wait, for compiled
forwards.
"""

from __future__ import annotations

import functools

import torch

from bsrun.inject import state

_DEPTH = [0]  # compiled calls running on the training thread, nested
_EAGER: list[tuple[object, str]] = []  # (owner, attribute): bsrun entry points dynamo must not trace
_COMPILED = [False]  # torch.compile was called


def tracing() -> bool:
    """Dynamo is tracing: bsrun's hooks must not put anything in the graph."""
    return torch.compiler.is_compiling()


def inside_compiled_call() -> bool:
    return _DEPTH[0] > 0


def used() -> bool:
    """torch.compile was called in this process."""
    return _COMPILED[0]


def keep_eager(owner, attribute: str) -> None:
    """`owner.attribute` (a function, looked up at each call) runs eagerly under torch.compile."""
    _EAGER.append((owner, attribute))


def _disable_tracing_of_bsrun() -> None:
    while _EAGER:
        owner, attribute = _EAGER.pop()
        setattr(owner, attribute, torch.compiler.disable(getattr(owner, attribute), recursive=True))


def _settled_first(compiled):
    @functools.wraps(compiled)
    def call(*args, **kwargs):
        if state.MODELS and _DEPTH[0] == 0 and not tracing():
            state.say_once("torch.compile: bsrun finishes the scheduled communication before each "
                           "compiled call (the per-layer wait of the next forward pass applies to eager "
                           "code only)")
            state.flush_all()
        _DEPTH[0] += 1
        try:
            return compiled(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1
    return call


def install() -> None:
    original = torch.compile

    @functools.wraps(original)
    def compile(model=None, *args, **kwargs):
        _COMPILED[0] = True
        _disable_tracing_of_bsrun()
        result = original(model, *args, **kwargs)
        if model is None:  # used as @torch.compile(...): its decorator calls this again
            return result
        if isinstance(result, torch.nn.Module):  # an OptimizedModule
            result.forward = _settled_first(result.forward)
            return result
        return _settled_first(result)

    torch.compile = compile
