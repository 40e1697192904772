"""The PyTorch side of scheduling one model: hooks, the dependency proxy, updates.

Threads: the training thread runs the user's script, the grad hooks and every optimizer
update; the scheduler's thread only moves gradient bytes. So the user's optimizer and
parameters are never touched concurrently, and the only shared state is the small
bookkeeping below, guarded by one condition variable.

The life of a parameter in one round:
  backward: its grad hook marks it ready -> its partitions go to the scheduler, and the
  parameter is trapped (bsrun/inject/trap.py): a read of it by the script settles it first
  comm thread: partitions all-reduced and averaged in place -> `done` counted
  step(): updated now if its communication is done, else left pending
  next forward: the pre-hook of each module that owns it waits for exactly its own
  parameters, applies their pending update (and a deferred zero_grad), then the
  module runs. That is ByteScheduler's dependency proxy. A settled parameter is released.
Adaptation's unscheduled-like point runs on DDP's own reducer where the model lends one
(`ddp_reducer`, ScheduledDDP's): bsrun's hooks are off and each forward goes through a
genuine DDP around the same module, so that point costs what the unscheduled run costs.
DDP's find_unused_parameters=True: bsrun/inject/unused.py; Join: bsrun/inject/join.py.
"""

from __future__ import annotations

import threading
from collections import Counter

import torch

from bsrun.inject import compiled, state, trap
from bsrun.inject.adapt import Adapter
from bsrun.inject.backward_end import BackwardEnd
from bsrun.inject.order import DependencyCounter, transfer_order
from bsrun.inject.replicas import ReplicaCheck
from bsrun.inject.unused import UnusedParameters
from bsrun.inject.updates import Updates
from bsrun.sched.adaptive import unscheduled_like
from bsrun.sched.core import Scheduler, Transport
from bsrun.sched.partition import TensorInfo, plan_partitions
from bsrun.sched.row_sparse import embedding_tables
from bsrun.sched.task import Layout, credit_charges, forward_order


def why_not_schedulable(params: list[torch.Tensor], modules) -> str | None:
    """What ModelRuntime itself cannot schedule exactly, whoever built the model (DDP or
    Horovod): the reason, or None. `params` require gradients; `modules` use them."""
    if not params:
        return "no parameter requires a gradient"
    if any(p.device.type != "cpu" for p in params):
        return "parameters not on the CPU"
    if any(getattr(m, "sparse", False) is True for m in modules):
        return "sparse gradients"
    return None


class ModelRuntime(Updates):
    """Scheduling state of one model's parameters (waiting and updating: bsrun/inject/updates.py)."""

    def __init__(self, named_params, modules, config, transport: Transport, passes_per_sync: int = 1,
                 unused_group=None):
        """`named_params`: (name, parameter) pairs; `modules`: those whose forward uses them
        (their pre-hooks are the dependency proxy); `passes_per_sync`: backward passes
        accumulated locally per communication (Horovod's backward_passes_per_step);
        `unused_group`: DDP's find_unused_parameters=True, the group that sums the used maps
        (bsrun/inject/unused.py)."""
        self.config = config
        self.transport = transport
        self.passes_per_sync = passes_per_sync
        named = [(name, p) for name, p in named_params if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        modules = list(modules)
        self.table_rows = embedding_tables(self.params, modules)  # > 0: may go by nonzero rows
        unguarded = sorted({type(p).__name__ for p in self.params if not trap.trappable(p)})
        if unguarded:
            state.say_once(f"parameters of class {', '.join(unguarded)} cannot be guarded against early reads: "
                           f"code that reads them between backward() and the next forward sees them settled "
                           f"only at bsrun's flush points (state_dict, torch.save, clipping, zero_grad); call "
                           f"bsrun.synchronize() before such reads")
        n = len(self.params)
        self.accumulated = [0] * n     # backward passes since the last communication
        self.ready = [0] * n           # rounds in which the grad hook fired
        self.done = [0] * n            # rounds whose communication finished
        self.grads: list[torch.Tensor | None] = [None] * n
        self.pending: dict[int, tuple] = {}       # param -> (optimizer, snapshot, group index)
        self.deferred_zero: dict[int, bool] = {}  # param -> set_to_none, applied after its update
        self.cv = threading.Condition()
        self.error: BaseException | None = None
        self.sync_backward = True                 # set by each forward (no_sync turns it off)
        self.rounds = 0                           # synchronising backward passes ended
        self.unused = UnusedParameters(unused_group, n) if unused_group is not None else None
        self.writeback = self.unused.writeback if self.unused is not None else {}  # param -> owed (unused.py)
        self.first_use: list[int] = []
        self._first_use_seen: set[int] = set()
        self.layout: Layout | None = None
        self.partition_bytes = config.partition    # until rank 0's values are agreed at the
        self.credit_bytes = config.credit_bytes    # first synchronising backward pass
        self.scheduler: Scheduler | None = None
        self.retired_stats: Counter = Counter()  # the counts of schedulers an adaptation replaced
        self.configured_order_name = self.order_name = config.order.partition(":")[0]
        self.configured_order: list[int] = []   # agreed at the first synchronising backward
        self.fifo_order: list[int] = []
        self.proxy = True                       # per-layer waits; False: step() waits for all
        self.ddp_reducer = None  # ScheduledDDP's: why DDP's own reducer cannot run the unscheduled-like point now
        self.on_ddp = False      # it does: bsrun's hooks are off, DDP's reducer averages
        self.ddp_rounds = 0
        self._modules = modules
        self.adapter = Adapter(self)
        self._seen_this_backward: set[int] = set()
        self._backward_end = BackwardEnd(self._end_of_backward)
        self.replicas = ReplicaCheck(config.check_every, self.names, self.transport.agree)
        self._handles = []
        self.dependencies = DependencyCounter(self.index) if config.order == "tic" else None
        self._register_hooks(modules)
        state.MODELS.add(self)

    # --- hooks ------------------------------------------------------------------------

    def _register_hooks(self, modules) -> None:
        for module in modules:
            owned = sorted({self.index[id(p)] for p in module._parameters.values()
                            if p is not None and id(p) in self.index})
            if owned:
                self._handles.append(module.register_forward_pre_hook(
                    lambda _m, _inputs, owned=owned: self.before_forward(owned)))
                self._handles.append(module.register_state_dict_pre_hook(
                    lambda *_args: self.flush()))
                if self.dependencies is not None:
                    self._handles.append(module.register_forward_hook(
                        lambda _m, _inputs, output, owned=owned: self._note_output(owned, output)))
        for p in self.params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def partitions(self):
        return self.layout.partitions if self.layout is not None else None

    @trap.internal
    def before_forward(self, owned: list[int]) -> None:
        if compiled.tracing():
            return  # dynamo traces this forward: every compiled call starts settled instead
        if self.layout is None:
            for i in owned:
                if i not in self._first_use_seen:
                    self._first_use_seen.add(i)
                    self.first_use.append(i)
        self.settle(owned)

    def _note_output(self, owned: list[int], output) -> None:
        if self.layout is None:  # until the order is fixed
            self.dependencies.module_output(owned, output)

    @trap.internal
    def _on_grad(self, param) -> None:
        i = self.index[id(param)]
        if self.unused is not None:
            self.unused.note_used(i)  # under no_sync too, as DDP's local used map
        if not self.sync_backward:
            return  # inside no_sync(): gradients accumulate locally
        if i in self._seen_this_backward:
            raise RuntimeError(state.failed(
                f"Expected to mark a variable ready only once: the gradient of {self.names[i]} arrived "
                f"twice in one backward pass (a parameter used both inside and outside a reentrant "
                f"torch.utils.checkpoint segment?); plain DDP fails here too; use_reentrant=False avoids it"))
        self.accumulated[i] += 1
        if self.accumulated[i] < self.passes_per_sync:
            return  # backward_passes_per_step: accumulate locally this time
        self._backward_end.arm()
        self._seen_this_backward.add(i)
        self._mark_ready(i)

    def _mark_ready(self, i: int, grad: torch.Tensor | None = None, shadow: bool = False) -> None:
        """Parameter i's contribution to this round: its `.grad`, or `grad` (contiguous).
        `shadow`: a joined rank's zeros (Join), which leave the parameter as it is."""
        if self.scheduler is None:
            self._start()
        self.accumulated[i] = 0
        param = self.params[i]
        if grad is None:
            if not param.grad.is_contiguous():
                param.grad = param.grad.contiguous()
            grad = param.grad
        with self.cv:
            self.grads[i] = grad
            self.ready[i] += 1
        if not shadow:
            trap.trap(param, self, i)
        for pid in self.layout.tensor_ready(i):
            self.scheduler.mark_ready(pid)

    @trap.internal
    def _end_of_backward(self) -> None:
        """Parameters the forward pass did not use still take part: with zero gradients, or
        with find_unused_parameters=True as DDP does (bsrun/inject/unused.py).
        Inside a compiled call, whatever follows the backward is compiled code: settle."""
        self.rounds += 1
        missing = [i for i in range(len(self.params)) if i not in self._seen_this_backward]
        self._seen_this_backward = set()
        if missing and self.unused is None:
            state.say_once(f"{len(missing)} parameter(s) got no gradient in a backward pass; "
                     f"bsrun all-reduces zeros for them (DDP would need find_unused_parameters=True)")
        if missing:
            self.settle(missing)  # no forward waited for them: finish their last round first
        if self.unused is not None:
            for i, grad in self.unused.end_of_backward(missing, self.params).items():
                self._mark_ready(i, grad)
        else:
            for i in missing:
                if self.params[i].grad is None:
                    self.params[i].grad = torch.zeros_like(self.params[i])
                self._mark_ready(i)
        if compiled.inside_compiled_call():
            self.flush()

    @trap.internal
    def shadow_round(self) -> None:
        """A joined rank's part in a round of the others (Join): zeros for every gradient, in
        the agreed partitions and order; its own parameters and gradients stay as they are."""
        self.flush()  # the backend reads `grads` until a round is finished
        for i, param in enumerate(self.params):
            self._mark_ready(i, torch.zeros_like(param, memory_format=torch.contiguous_format), shadow=True)
        self.wait_for(range(len(self.params)))

    def force_accumulated(self) -> None:
        """Horovod's step()/synchronize() before backward_passes_per_step passes: what has
        accumulated is communicated now (and unused parameters with zeros), as Horovod does."""
        partial = [i for i, n in enumerate(self.accumulated) if n > 0]
        for i in partial:
            self._seen_this_backward.add(i)
            self._mark_ready(i)
        if partial:
            self._end_of_backward()

    # --- layout and scheduler ------------------------------------------------------------

    def _start(self) -> None:
        """First synchronising backward: fix the priority order (rank 0's) and the partitions."""
        forward = forward_order(self.first_use, self.names)
        order = self._transfer_order(forward)
        mine = [self.partition_bytes, self.credit_bytes]
        fifo = transfer_order("fifo", forward, self.names, None)  # adaptation's; the forward order is local
        n = len(self.params)
        agreed = self.transport.agree(mine + order + fifo)
        (self.partition_bytes, self.credit_bytes) = agreed[:2]
        self.configured_order, self.fifo_order = agreed[2:2 + n], agreed[2 + n:]
        if agreed[:2] != mine:
            state.warn(f"partition {mine[0]} B and credit {mine[1]} B here differ from rank 0's "
                       f"({self.partition_bytes} B, {self.credit_bytes} B); every rank uses rank 0's")
        self.adapter.started()  # it may start from the point an earlier run learned
        self._lay_out(self._order_named(self.order_name))

    def _lay_out(self, order: list[int]) -> None:
        """Partitions of `partition_bytes` in `order`, and a scheduler for them."""
        sparse = self.transport.row_sparse
        infos = [TensorInfo(p.numel(), p.element_size(), str(p.dtype), rows if sparse else 0)
                 for p, rows in zip(self.params, self.table_rows)]
        self.layout = Layout(plan_partitions(infos, order, self.partition_bytes), len(self.params))
        backend = self.transport.backend(self.partitions, lambda i: self.grads[i],
                                         {str(p.dtype): p.dtype for p in self.params})
        recorder = state.recorder
        trace = recorder.scheduler_trace(self) if recorder is not None else None
        if self.adapter.explorer is not None:
            trace = self.adapter.observer(trace)
        self.scheduler = Scheduler(backend, credit_charges(self.partitions, self.partition_bytes),
                                   self.transport.credit(self.credit_bytes),
                                   self._on_partition_done, self._on_error, trace=trace)

    @trap.internal
    def reconfigure(self, point) -> None:
        """Every rank after the same step (bsrun/inject/adapt.py): this round finished and
        every pending update applied, then the partitions laid out anew for `point`, or
        for the unscheduled-like point DDP's own reducer where it can run it."""
        self.flush()
        if self.scheduler is not None:
            self.scheduler.close()
            self.retired_stats.update(self.scheduler.stats)
            self.scheduler = None
        self.partition_bytes, self.credit_bytes, self.proxy = point.partition, point.credit_bytes, point.proxy
        self.order_name = point.order
        on_ddp = self.can_run_on_ddp(point)
        if on_ddp:
            self._remove_hooks()
        else:
            if self.on_ddp:
                self._register_hooks(self._modules)
            self._lay_out(self._order_named(point.order))
        self.on_ddp = on_ddp

    def can_run_on_ddp(self, point) -> bool:
        return point == unscheduled_like() and self.ddp_reducer is not None and self.ddp_reducer() is None

    def count_ddp_round(self) -> None:
        """A synchronising forward on DDP's reducer: its backward is a round (`rounds`)."""
        self.rounds += 1
        self.ddp_rounds += 1

    def _order_named(self, name: str) -> list[int]:
        return self.fifo_order if name == "fifo" else self.configured_order

    def _transfer_order(self, forward: list[int]) -> list[int]:
        """--order's priority; rank 0's wins at agreement."""
        try:
            return transfer_order(self.config.order, forward, self.names, self.dependencies)
        except (OSError, ValueError, KeyError) as e:
            state.say_once(f"--order {self.config.order}: {e}; using the forward order")
            return forward
        finally:
            if self.dependencies is not None:
                self.dependencies.release()

    def _on_partition_done(self, pid: int) -> None:  # comm thread
        finished = self.layout.partition_finished(pid)
        if finished:
            with self.cv:
                for i in finished:
                    self.done[i] += 1
                self.cv.notify_all()

    def _on_error(self, error: BaseException) -> None:  # comm thread
        with self.cv:
            self.error = error
            self.cv.notify_all()

    def counters(self) -> dict:
        stats = self.retired_stats + Counter(self.scheduler.stats if self.scheduler else {})
        return {"tasks": sum(self.done), "partitions": stats.get("partitions", 0),
                "bytes": stats.get("bytes", 0), "rounds": stats.get("rounds", 0),
                "negotiations": stats.get("negotiations", 0), "replayed_rounds": stats.get("replayed_rounds", 0),
                "ddp_rounds": self.ddp_rounds, "checks": self.replicas.checks}

    def close(self) -> None:
        """Stop the scheduler's threads and take the hooks off the model."""
        if self.scheduler is not None:
            self.scheduler.close(timeout=0 if self.error else 5.0)  # a failed one may be stuck in gloo
        self._remove_hooks()  # its counters stay in state.MODELS for the run report
        for param in self.params:
            trap.release(param)
