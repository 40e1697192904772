"""Horovod: `hvd.DistributedOptimizer` hands its gradients to bsrun's scheduler.

The script's own optimizer comes back, scheduled like a DDP model's: gradient hooks,
partitions in priority order through Horovod's named asynchronous all-reduce (see
sched/horovod_backend.py), the dependency proxy on the modules that use the parameters,
per-layer updates. What scripts call on Horovod's optimizer keeps working:
`synchronize()` (everything communicated and updated), `skip_synchronize()`,
`backward_passes_per_step` and `set_backward_passes_per_step()`; `broadcast_parameters`
and `broadcast_optimizer_state` go through the flushing state_dict and step. Where bsrun
cannot match Horovod exactly it builds Horovod's own optimizer and says why once.
"""

from __future__ import annotations

import contextlib
import gc
import inspect

import horovod.torch as hvd
import torch
from horovod.torch import optimizer as hvd_optimizer

from bsrun.inject import state
from bsrun.inject.runtime import ModelRuntime, why_not_schedulable
from bsrun.sched.horovod_backend import HorovodTransport

_GENUINE = hvd_optimizer.DistributedOptimizer
_SIGNATURE = inspect.signature(_GENUINE)


def fallback_reason(params: list[torch.Tensor], modules: list[torch.nn.Module], args: dict) -> str | None:
    """Why this optimizer must stay Horovod's, or None when bsrun can schedule it exactly."""
    if hvd.size() == 1:
        return "a single Horovod process"
    if args["compression"] is not hvd.Compression.none:
        return "gradient compression"
    if args["op"] not in (hvd.Average, hvd.Sum):
        return "a reduction other than Average or Sum"
    if args["process_set"] is not hvd.global_process_set:
        return "a process set"
    if args["backward_passes_per_step"] < 1:
        return "backward_passes_per_step < 1"
    reason = why_not_schedulable(params, modules)
    if reason is not None:
        return reason
    named = args["named_parameters"]
    if named is not None:
        named = list(named)
        args["named_parameters"] = named
        names = [n for n, _ in named]
        if len(set(names)) != len(names) or not {id(p) for p in params} <= {id(v) for _, v in named}:
            return "named_parameters that Horovod itself rejects"
    return None


def modules_using(params: list[torch.Tensor]) -> list[torch.nn.Module]:
    """Every live module that holds one of `params` directly: where the pre-hooks go.

    Horovod is given parameters, not the model; the modules that own them are found
    once among the live objects.
    """
    ids = {id(p) for p in params}
    return [obj for obj in gc.get_objects() if issubclass(type(obj), torch.nn.Module)
            and any(id(v) in ids for v in obj._parameters.values() if v is not None)]


def _give_horovod_methods(optimizer, rt: ModelRuntime) -> None:
    """The methods of Horovod's optimizer that scripts call, on the script's optimizer."""
    def synchronize():
        rt.force_accumulated()
        rt.flush()

    def set_backward_passes_per_step(passes: int):
        rt.passes_per_sync = passes

    optimizer.synchronize = synchronize
    optimizer.skip_synchronize = contextlib.nullcontext
    optimizer.set_backward_passes_per_step = set_backward_passes_per_step


def DistributedOptimizer(*args, **kwargs):
    state.become_worker(hvd.rank(), hvd.size())  # building one makes this process a worker (bootstrap.py)
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    optimizer = a["optimizer"]
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    modules = modules_using(params)
    reason = fallback_reason(params, modules, a)
    if reason is not None:
        state.say_once(f"not scheduling this optimizer ({reason}); it runs as Horovod's DistributedOptimizer")
        state.set_mode("fallback")
        return _GENUINE(**a)
    if a["groups"] or a["num_groups"]:
        state.say_once("Horovod's groups are replaced by bsrun's partitions (same results)")
    names = {id(p): n for n, p in a["named_parameters"] or ()}  # else Horovod's own default names
    named = [(names.get(id(p), f"allreduce.noname.{i}.{j}"), p)
             for i, g in enumerate(optimizer.param_groups) for j, p in enumerate(g["params"])]
    config = state.config()
    if config.arch == "ps":
        state.say_once("--arch ps serves DistributedDataParallel models; this Horovod optimizer "
                       "is scheduled over Horovod's all-reduce")
    rt = ModelRuntime(named, modules, config, HorovodTransport(a["op"], a["gradient_predivide_factor"]),
                      passes_per_sync=a["backward_passes_per_step"])
    _give_horovod_methods(optimizer, rt)
    state.set_mode("scheduled")
    return optimizer


def _flushing_shutdown(shutdown):
    """Horovod's shutdown, after this rank's scheduled work is finished. `hvd.init()`
    registers the shutdown with atexit after bsrun's own exit handler, so it would run
    first and leave the last round's collectives without Horovod."""
    def shutdown_after_flush(*args, **kwargs):
        state.flush_all()
        return shutdown(*args, **kwargs)
    return shutdown_after_flush


def install() -> None:
    """Called by the bootstrap once horovod.torch is imported (before the script's
    hvd.init()), only with scheduling on."""
    from horovod.common.basics import HorovodBasics
    from horovod.torch import mpi_ops

    hvd.DistributedOptimizer = DistributedOptimizer
    hvd_optimizer.DistributedOptimizer = DistributedOptimizer
    HorovodBasics.shutdown = _flushing_shutdown(HorovodBasics.shutdown)  # the method atexit will hold
    hvd.shutdown = mpi_ops.shutdown = _flushing_shutdown(mpi_ops.shutdown)
