"""ScheduledDDP: DistributedDataParallel's interface, bsrun's gradient synchronisation.

A subclass, so `isinstance(model, DistributedDataParallel)` still holds, that does not
build DDP's reducer (so DDP never all-reduces as well). It keeps what scripts rely on:
`.module` (and so the `module.` state_dict keys), `no_sync()`, the initial broadcast of
parameters and buffers from rank 0, the buffer broadcast before each forward, averaging
by world size. Where bsrun cannot be exactly right it builds the real DDP instead and
says why once.
"""

from __future__ import annotations

import contextlib
import inspect
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, _JoinConfig
from torch.nn.parallel.distributed import DistributedDataParallel

from bsrun.config import SchedConfig
from bsrun.inject import comm_hooks, compiled, join, state
from bsrun.inject.ddp_surface import DDPSurface
from bsrun.inject.runtime import ModelRuntime, why_not_schedulable
from bsrun.sched.ps_backend import PSTransport
from bsrun.sched.torch_backend import TorchTransport

_SIGNATURE = inspect.signature(DistributedDataParallel.__init__)
_UNSUPPORTED_ARGS = ("device_ids", "output_device", "mixed_precision", "device_mesh",
                     "delay_all_reduce_named_params", "param_to_hook_all_reduce")


def fallback_reason(module: torch.nn.Module, args: dict, config: SchedConfig) -> str | None:
    """Why this DDP must stay plain DDP, or None when bsrun can schedule it exactly."""
    if args.get("skip_all_reduce_unused_params"):
        return "DDP argument skip_all_reduce_unused_params"
    for name in _UNSUPPORTED_ARGS:
        if args.get(name) is not None:
            return f"DDP argument {name}"
    group = args["process_group"] or dist.distributed_c10d._get_default_group()
    if dist.get_backend(group) != "gloo":
        return f"the {dist.get_backend(group)} backend (bsrun schedules gloo process groups)"
    if config.arch == "ps" and dist.get_world_size(group) != dist.get_world_size():
        return "--arch ps with a process group of only some ranks (the servers serve the whole job)"
    return why_not_schedulable([p for p in module.parameters() if p.requires_grad], module.modules())


def broadcast_from(tensors, group, src: int = 0) -> None:
    """Group rank `src`'s values (rank 0 unless told) into every rank's tensors, one collective per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for ts in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            dist.broadcast(flat, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
            offset = 0
            for t in ts:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


class _AnyDDP(type(DistributedDataParallel)):
    """Scripts hold `DistributedDataParallel` as it was looked up after our patch, i.e.
    ScheduledDDP; `isinstance(model, DDP)` must still hold for a model that fell back to
    the genuine class."""

    def __instancecheck__(cls, obj):
        return cls.__subclasscheck__(type(obj))

    def __subclasscheck__(cls, sub):
        # By the MRO, not issubclass: DDP's ABCMeta would ask this class again, forever.
        return isinstance(sub, type) and DistributedDataParallel in sub.__mro__


class ScheduledDDP(DDPSurface, DistributedDataParallel, metaclass=_AnyDDP):
    def __init__(self, *args, **kwargs):
        if dist.is_initialized():  # building a DDP model makes this process a worker (bootstrap.py)
            state.become_worker(dist.get_rank(), dist.get_world_size())
        bound = _SIGNATURE.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        module = a["module"]
        config = state.config()
        reason = fallback_reason(module, a, config)
        if reason is not None:
            state.say_once(f"not scheduling this model ({reason}); it runs as plain DDP")
            state.set_mode("fallback")
            super().__init__(*args, **kwargs)
            self.__class__ = DistributedDataParallel  # from here on, exactly plain DDP
            return
        torch.nn.Module.__init__(self)
        # the script's arguments, defaults filled in: read by DDP's attributes (ddp_surface), and
        # to build the genuine DDP (adaptation's unscheduled-like point, or becoming plain DDP)
        self._bsrun_ddp_arguments = {k: v for k, v in a.items() if k != "self"}
        self.module = module
        self.process_group = a["process_group"] or dist.distributed_c10d._get_default_group()
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.forward_sync_buffers = (a["forward_sync_buffers"] if a["forward_sync_buffers"] is not None
                                     else a["broadcast_buffers"] if a["broadcast_buffers"] is not None
                                     else True)
        transport = PSTransport if config.arch == "ps" else TorchTransport
        self._bsrun_transport = transport(dist.get_process_group_ranks(self.process_group),
                                          timedelta(seconds=config.timeout))
        self._bsrun = ModelRuntime(module.named_parameters(), module.modules(), config, self._bsrun_transport,
                                   unused_group=(self._bsrun_transport.control_group
                                                 if a["find_unused_parameters"] or a["static_graph"] else None))
        self._join_config = _JoinConfig.construct_disabled_join_config()  # Joinable's; Join sets it
        self._bsrun_announced: join.Announcement | None = None  # under Join: this forward's
        self.modules_buffers = list(module.buffers())
        if a["init_sync"]:
            broadcast_from(list(module.parameters()) + self.modules_buffers,
                                 self._bsrun_transport.control_group)
        self._bsrun.ddp_reducer = self._why_not_on_ddp
        self._bsrun_joins = False  # Join was entered: the joined ranks shadow bsrun's rounds only
        state.set_mode("scheduled")

    def forward(self, *inputs, **kwargs):
        if self._bsrun.on_ddp:
            return self._ddp_forward(*inputs, **kwargs)
        self._pre_forward()
        return self.module(*inputs, **kwargs)

    def _why_not_on_ddp(self) -> str | None:
        """Why adaptation's unscheduled-like point cannot run on DDP's own reducer now, or None."""
        if self._bsrun.unused is not None or self._bsrun_ddp_arguments["gradient_as_bucket_view"]:
            return "find_unused_parameters, static_graph or gradient_as_bucket_view"
        if isinstance(self._bsrun_transport, PSTransport) or self._bsrun_transport.reduce is not None:
            return "a comm hook or parameter servers"
        if self._bsrun_joins:
            return "Join"
        if compiled.used():
            return "torch.compile"
        return None

    def _ddp_forward(self, *inputs, **kwargs):
        """A forward at the unscheduled-like point: through a genuine DDP around the same
        module (built at its first use, kept out of this module's children and state_dict),
        whose reducer averages the gradients by the backward's end."""
        ddp = self.__dict__.get("_bsrun_ddp")
        if ddp is None:
            # init_sync off: the replicas are equal, bsrun's rounds keep them so
            ddp = DistributedDataParallel(**{**self._bsrun_ddp_arguments, "init_sync": False})
            self.__dict__["_bsrun_ddp"] = ddp
        ddp.require_backward_grad_sync = self.require_backward_grad_sync
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._bsrun.count_ddp_round()
        return ddp(*inputs, **kwargs)

    def _pre_forward(self) -> None:
        """DDP's buffer broadcast and the sync decision of this forward (eager under compile);
        under Join, DDP's notification and what joined ranks shadow (bsrun/inject/join.py)."""
        joining = self._join_config.enable
        if joining:
            Join.notify_join_context(self)
        if self.require_forward_param_sync and self.forward_sync_buffers and self.modules_buffers:
            self.modules_buffers = list(self.module.buffers())
            group = self._bsrun_transport.control_group
            self._broadcast_buffers(join.common_rank(group, True) if joining else 0)
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._bsrun_announced is not None:
            self._bsrun_announced.work.wait()  # the last iteration's, long finished
        self._bsrun_announced = join.Announcement(self._bsrun_transport.control_group, sync) if joining else None
        self._bsrun.sync_backward = sync
        self.require_forward_param_sync = sync

    def _broadcast_buffers(self, src: int) -> None:
        broadcast_from(self.modules_buffers, self._bsrun_transport.control_group, src)

    def _broadcast_model(self, src: int) -> None:
        """Join's end: the model from group rank `src` (DDP's _sync_final_model)."""
        buffers = list(self.module.buffers()) if self.forward_sync_buffers else []
        broadcast_from(list(self.module.parameters()) + buffers, self._bsrun_transport.control_group, src)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """DDP's join(): uneven inputs (bsrun/inject/join.py)."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        if not kwargs.get("divide_by_initial_world_size", True):  # bsrun's rounds divide by the world size
            self._bsrun_become_plain("join(divide_by_initial_world_size=False)")
            return self.join_hook(**kwargs)
        self._bsrun_joins = True
        if self._bsrun.on_ddp:  # every rank, entering Join: back to bsrun's rounds, which it shadows
            self._bsrun.reconfigure(self._bsrun.adapter.point())
        return join.ScheduledJoinHook(self)

    @property
    def join_device(self):
        return next(iter(self.module.parameters())).device

    @property
    def join_process_group(self):
        return self.process_group

    @contextlib.contextmanager
    def no_sync(self):
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state, hook):  # DDP's names: Lightning and accelerate pass them as keywords
        """DDP's known hooks run on bsrun's partitions, on bsrun's data group in place of the
        model's (bsrun/inject/comm_hooks.py); any other hook makes the model the real DDP,
        said once. Either only before the model's first backward pass, as DDP asks."""
        if self._comm_hooks:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        reason = (comm_hooks.why_not_scheduled(hook, state, self.process_group)
                  if isinstance(self._bsrun_transport, TorchTransport) else "a DDP comm hook with --arch ps")
        if reason is not None:
            self._bsrun_become_plain(reason)
            return self.register_comm_hook(state, hook)
        if self._bsrun.layout is not None:
            raise RuntimeError("bsrun already schedules this model's gradients, so a DDP comm hook can "
                               "only be registered before its first backward pass; run with --no-schedule "
                               "to use it later")
        DistributedDataParallel._check_comm_hook(self, hook)  # DDP's own checks, DDP's errors
        self._comm_hooks.append((hook, state))
        self._bsrun_transport.reduce = comm_hooks.ScheduledHook(hook, state, self._bsrun.params)

    def _become_plain_ddp(self, reason: str) -> None:
        """From here on exactly the DDP the script asked for (no round of bsrun's has begun),
        with the comm hook it already registered."""
        self._bsrun.close()
        state.withdraw(self._bsrun)
        state.say_once(f"not scheduling this model ({reason}); it runs as plain DDP")
        hooks = list(self.__dict__.get("_comm_hooks", ()))
        DistributedDataParallel.__init__(self, **self._bsrun_ddp_arguments)
        self.__class__ = DistributedDataParallel
        for hook, hook_state in hooks:
            self.register_comm_hook(hook_state, hook)

    def __getstate__(self):
        raise RuntimeError("a bsrun-scheduled DDP model cannot be pickled; save model.module "
                           "or its state_dict() instead")


compiled.keep_eager(ScheduledDDP, "_pre_forward")
compiled.keep_eager(ScheduledDDP, "_ddp_forward")
