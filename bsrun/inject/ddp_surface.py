"""The rest of DDP's surface that libraries read and call, answered for a model bsrun schedules.

ScheduledDDP never builds DDP's reducer or logger, yet Lightning, accelerate and
transformers read DDP's attributes and call a few of its private methods at run time:

- Lightning: `model.static_graph` and `model.find_unused_parameters` (manual
  optimisation's `prepare_for_backward`), `model.reducer._rebuild_buckets()` and
  `model.reducer.prepare_for_backward(tensors)` (before each `manual_backward`),
  `model.reducer._delay_all_reduce()` (first backward of a static graph, manual
  optimisation), `model._get_ddp_logging_data().get("can_set_static_graph")` (teardown),
  `require_backward_grad_sync` flipped around the forward, `register_comm_hook`.
- accelerate: `require_backward_grad_sync`/`require_forward_param_sync` and
  `model.reducer.prepare_for_backward([])` (`trigger_sync_in_backward`), `register_comm_hook`.
- transformers: only constructor arguments (`find_unused_parameters`, `static_graph`,
  `bucket_cap_mb`), `no_sync` and `.module`.

Each answer is honest. Attributes that DDP sets from its arguments read the arguments
(`static_graph`, `find_unused_parameters`, `gradient_as_bucket_view`: bsrun's gradients
are each parameter's own contiguous `.grad`, which it all-reduces in place or through a
staging buffer, so the flag changes nothing but what it reads as). The reducer's
`prepare_for_backward` means "the next backward synchronises": bsrun's next backward
does. `_rebuild_buckets` and `_delay_all_reduce` have nothing to do (bsrun's partitions
are fixed at the first backward and it never delays). What would need DDP's own machinery
(`_register_fused_optim`) makes the model the real DDP before its first backward, said
once, and is refused after; what bsrun cannot do (`_update_process_group`, removing the
reducer's hooks) raises a clear error.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel.distributed import DistributedDataParallel

from bsrun.inject.unused import track_unused

# DDP attributes that come straight from a constructor argument
_FROM_ARGUMENTS = ("static_graph", "find_unused_parameters", "gradient_as_bucket_view", "dim",
                   "skip_all_reduce_unused_params", "batched_grad_copy", "mixed_precision")
# DDP attributes with a fixed value for a model bsrun schedules
_FIXED = {"device_ids": None, "output_device": None, "logger": None, "_delay_all_reduce_all_params": False,
          "_delay_all_reduce_params": [], "_use_python_reducer": False, "_ddp_sink_clone": True,
          "_static_graph_delay_allreduce_enqueued": False, "_has_rebuilt_buckets": True,
          "_module_copies": None, "is_multi_device_module": False}
_SURFACE = set(_FROM_ARGUMENTS) | set(_FIXED) | {"reducer", "_comm_hooks", "device", "bucket_bytes_cap"}


class BsrunReducer:
    """`model.reducer` of a scheduled model: the calls libraries make on DDP's C++ reducer."""

    def __init__(self, model):
        self._model = model
        self.runtime_logging_sample_rate = 100

    def prepare_for_backward(self, outputs=()) -> None:
        """DDP arms its reducer for the next backward (Lightning's manual_backward, accelerate's
        trigger_sync_in_backward): bsrun's next backward synchronises."""
        self._model._bsrun.sync_backward = True

    def _rebuild_buckets(self) -> bool:
        return False  # bsrun's partitions are laid out once, at the first synchronising backward

    def _delay_all_reduce(self) -> None:
        pass  # bsrun never delays the first static-graph backward: its gradients are already under way

    def _set_static_graph(self) -> None:
        pass

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        self.runtime_logging_sample_rate = sample_rate

    def _check_reducer_finalized(self) -> None:
        pass  # every round bsrun begins is finished before any read of its gradients

    def _remove_autograd_hooks(self) -> None:
        raise RuntimeError("bsrun schedules this model's gradients and cannot stop synchronising them; "
                           "run with --no-schedule to remove DDP's hooks")

    def _update_process_group(self, group) -> None:
        raise RuntimeError("bsrun cannot move a scheduled model to another process group; "
                           "run with --no-schedule for DDP's _update_process_group")


class DDPSurface:
    """Mixin for ScheduledDDP (which sets `_bsrun_ddp_arguments`, `_bsrun`, `process_group`)."""

    def __getattr__(self, name):
        if name in _SURFACE:
            value = self._surface_value(name)
            object.__setattr__(self, name, value)  # set once: from here on a plain attribute
            return value
        return super().__getattr__(name)

    def _surface_value(self, name):
        if name in _FIXED:
            value = _FIXED[name]
            return list(value) if isinstance(value, list) else value
        if name == "reducer":
            return BsrunReducer(self)
        if name == "_comm_hooks":
            return []
        if name == "device":
            return next(iter(self.module.parameters())).device
        arguments = self.__dict__["_bsrun_ddp_arguments"]
        if name == "bucket_bytes_cap":
            return int(arguments["bucket_cap_mb"] * 1024 * 1024) if arguments["bucket_cap_mb"] else 25 * 1024 * 1024
        return arguments.get(name)

    def _set_static_graph(self) -> None:
        """As DDP: say so if it already was. A static graph's reducer leaves the gradients of
        parameters no rank used untouched, as find_unused_parameters does: so does bsrun."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        self.static_graph = True
        if self._bsrun.unused is None:
            track_unused(self._bsrun, self._bsrun_transport.control_group)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate) -> None:
        if sample_rate < 1:
            raise ValueError("DDP runtime logging sample rate should be equal or greater than 1")
        self.reducer._set_ddp_runtime_logging_sample_rate(sample_rate)

    def _get_ddp_logging_data(self) -> dict:
        """DDP's keys, with bsrun's values (its partitions in place of DDP's buckets)."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        runtime = self._bsrun
        parts = runtime.partitions or []
        data = {
            "module_name": type(self.module).__name__,
            "backend_name": dist.get_backend(self.process_group),
            "world_size": dist.get_world_size(self.process_group),
            "rank": dist.get_rank(self.process_group),
            "device_ids": "", "output_device": -1, "is_multi_device_module": 0,
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "find_unused_parameters": int(bool(self.find_unused_parameters)),
            "gradient_as_bucket_view": int(bool(self.gradient_as_bucket_view)),
            "broadcast_buffers": int(bool(self.forward_sync_buffers)),
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "dtypes": ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in params})),
            "bucket_sizes": ", ".join(str(p.nbytes) for p in parts),
            "has_sync_bn": int(any(isinstance(m, torch.nn.SyncBatchNorm) for m in self.module.modules())),
            "iteration": runtime.rounds,
            "master_addr": os.environ.get("MASTER_ADDR", "N/A"),
            "master_port": os.environ.get("MASTER_PORT", "N/A"),
            "bsrun": "scheduled", "bsrun_partition_bytes": runtime.partition_bytes,
            "bsrun_credit_bytes": runtime.credit_bytes,
        }
        if self.static_graph:
            data["static_graph"] = 1  # DDP's logger has the key only once it is set
        if self._comm_hooks:
            data["comm_hook"] = getattr(self._comm_hooks[-1][0], "__qualname__", "")
        return data

    def _bsrun_become_plain(self, what: str) -> None:
        """The real DDP from here on, if no round of bsrun's has begun; else a clear refusal."""
        if self._bsrun.layout is not None:
            raise RuntimeError(f"bsrun already schedules this model's gradients, so {what} can only be used "
                               f"before its first backward pass; run with --no-schedule to use it later")
        self._become_plain_ddp(what)

    def _register_fused_optim(self, optim, *args, optim_params=None, **kwargs):
        """DDP's optimizer-in-backward needs DDP's reducer: the real DDP, before the first backward."""
        self._bsrun_become_plain(f"DDP's _register_fused_optim ({getattr(optim, '__name__', optim)})")
        return self._register_fused_optim(optim, *args, optim_params=optim_params, **kwargs)

    def _register_builtin_comm_hook(self, comm_hook_type):
        """DDP's C++ hooks are its Python default hooks (same arithmetic): run those scheduled."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        hooks = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                 dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        return self.register_comm_hook(None, hooks[comm_hook_type])

    def _update_process_group(self, new_process_group):
        self.reducer._update_process_group(new_process_group)

    def _remove_autograd_hooks(self):
        self.reducer._remove_autograd_hooks()
