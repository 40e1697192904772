"""The in-worker recorder of `bsrun profile`: cheap spans, written a step at a time.

Installed by the bootstrap when BSRUN_PROFILE_DIR is set. Every rank appends to
`rank-<r>.jsonl` in that folder: JSON lines, each either `{"meta": ...}` (this rank, its
clock offset, a model's modules and parameters, a scheduler's partitions) or
`{"events": [...]}` (everything recorded since the last line, written at each optimizer
step and at exit). An interrupted run loses at most the step in progress, and a line cut
short by a kill is skipped by the reader (bsrun/profile/trace.py), which merges the
ranks into one Chrome trace.

What is recorded, in compact tuples (times are time.perf_counter_ns() of this rank):

    ("F", module, t0, t1)        a module's forward (forward pre-hook to forward hook)
    ("B", module, t0, t1)        a layer's backward: from the moment the gradient of its
                                 output arrives (a pre-hook on the output's grad_fn) to
                                 the moment the last of its own parameters' gradients is
                                 accumulated
    ("G", param, t)              a parameter's gradient is ready (post-accumulate hook)
    ("P", 0|1, t0, t1)           the model's forward pass, its backward pass
    ("W", t0, t1, [param...])    the training thread waited for these parameters'
                                 communication (bsrun's dependency proxy)
    ("Y", t0, t1)                DDP's forward before the model's own: the buffer broadcast
                                 from rank 0, so mostly waiting for the other ranks
    ("U", t0, t1, [param...])    an optimizer update of these parameters (None: a whole
                                 optimizer.step() of an unscheduled run)
    ("S", n, t)                  optimizer step n returned
    ("C", sched, pid, round, t_ready, t_post, t_finish)
                                 one partition of bsrun's scheduler: ready here, handed to
                                 the backend, finished
    ("D", model, bucket, step, nbytes, t_post, t_finish)
                                 one DDP bucket of an unscheduled run, timed by a comm hook
                                 that wraps DDP's own all-reduce (or the script's hook)
    ("K", model, bucket, [param...])  which parameters that bucket holds (when it changes)

Recording starts after WARMUP optimizer steps; with STEPS set, every rank ends the job at
step WARMUP + STEPS (as a tuning trial does: the scheduled work is finished, the ranks meet,
SystemExit(0) leaves the script's `finally` blocks and atexit handlers to run).

Clocks: when the first model is seen (DDP's constructor, the same point on every rank),
each rank measures its offset to rank 0 by a few ping-pongs over a gloo group of the
recorder's own, keeping the round with the shortest round trip (NTP's rule).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bsrun.config import PROFILE_DIR_ENV, PROFILE_STEPS_ENV, PROFILE_WARMUP_ENV, SchedConfig, worker_setting

now = time.perf_counter_ns
CLOCK_ROUNDS = 8
WAIT_MIN_NS = 20_000      # shorter "waits" are the dependency proxy finding nothing to wait for
TRIM_EVENTS = 100_000     # written events kept in memory before the list is cut
EXIT_GRACE_S = 30.0       # after the last recorded step, a process still alive is ended

RECORDER: "Recorder | None" = None


def _grad_node(output):
    """The autograd node of the first tensor in a module's output that has one."""
    if isinstance(output, torch.Tensor):
        return output.grad_fn
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        for item in output:
            if isinstance(item, torch.Tensor) and item.grad_fn is not None:
                return item.grad_fn
    return None


class Recorder:
    def __init__(self, rank: int, folder: Path, warmup: int, steps: int | None, scheduled: bool):
        self.rank, self.warmup, self.steps, self.scheduled = rank, warmup, steps, scheduled
        self.file = open(Path(folder) / f"rank-{rank}.jsonl", "w")
        self.lock = threading.Lock()          # one writer at a time
        self.events: list[tuple] = []         # appended from any thread (list.append is atomic)
        self.written = 0
        self.on = warmup == 0
        self.steps_done = 0
        self.started = False                  # the first boundary has been recorded
        self.group = None
        self.param_index: dict[int, int] = {}  # id(parameter) -> global parameter number
        self.modules = 0
        self.models = 0
        self.schedulers = 0
        self.buckets: dict[tuple[int, int], tuple] = {}
        self.bwd_start: list[int] = []
        self.bwd_left: list[int] = []
        self.global_hooks = []
        self.ended = False
        self.backward_began = 0               # a layer's backward began before the pass's own hook
        self.meta("rank", rank=rank, world_size=int(os.environ.get("WORLD_SIZE", "1")), pid=os.getpid(),
                  host=socket.gethostname(), scheduled=scheduled, warmup=warmup, steps=steps,
                  config=SchedConfig.from_env().as_dict(), wall_ns=time.time_ns(), clock_ns=now())

    # --- writing ----------------------------------------------------------------------

    def _write(self, obj) -> None:
        self.file.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self.file.flush()

    def meta(self, kind: str, **fields) -> None:
        with self.lock:
            if not self.file.closed:
                self._write({"meta": kind, **fields})

    def flush(self) -> None:
        with self.lock:
            n = len(self.events)
            if n > self.written and not self.file.closed:
                self._write({"events": self.events[self.written:n]})
            self.written = n
            if self.written > TRIM_EVENTS:
                del self.events[:self.written]
                self.written = 0

    def close(self) -> None:
        self.flush()
        self.meta("end", steps=self.steps_done, wall_ns=time.time_ns())
        with self.lock:
            self.file.close()

    # --- models -------------------------------------------------------------------------

    def watch(self, top: torch.nn.Module, root: torch.nn.Module, genuine_ddp, comm: str | None = None) -> None:
        """Hook `root`'s modules and parameters; `top` (the DDP wrapper, or the model) gives
        the passes; `genuine_ddp`: an unscheduled DDP whose buckets a comm hook times;
        `comm`: who communicates (default: bsrun, or the DDP hook)."""
        if self.models == 0:
            self.align_clock()
        model = self.models
        self.models += 1
        first_param = len(self.param_index)
        params = []
        for name, p in root.named_parameters():
            if p.requires_grad and id(p) not in self.param_index:
                self.param_index[id(p)] = first_param + len(params)
                params.append([name, p.numel(), p.element_size(), str(p.dtype).removeprefix("torch.")])
        modules = []
        owned_seen: set[int] = set()
        root_start = [0]  # when the model's own forward began (after DDP's buffer broadcast)
        for name, module in root.named_modules():
            own = [self.param_index[id(p)] for p in module._parameters.values()
                   if p is not None and id(p) in self.param_index and id(p) not in owned_seen]
            owned_seen.update(id(p) for p in module._parameters.values() if p is not None)
            index = self.modules + len(modules)
            modules.append([name or type(root).__name__, type(module).__name__, own])
            self.bwd_start.append(0)
            self.bwd_left.append(0)
            self._hook_module(module, index, [p for p in module._parameters.values()
                                              if p is not None and id(p) in self.param_index
                                              and self.param_index[id(p)] in own],
                              root_start if module is root else None)
        self.modules += len(modules)
        comm = comm or ("bsrun" if genuine_ddp is None else "ddp-hook")
        sync = top is not root and any(True for _ in root.buffers()) and bool(
            getattr(top, "forward_sync_buffers", getattr(top, "broadcast_buffers", False)))
        self.meta("model", model=model, first_module=self.modules - len(modules), first_param=first_param,
                  modules=modules, params=params, comm=comm, sync_buffers=sync)
        self._hook_passes(top, model, genuine_ddp, root_start)
        if genuine_ddp is not None and self.scheduled and not self.global_hooks:
            from bsrun.inject import runtime

            if not runtime.RUNTIMES:  # a fallback: its optimizer steps are whole, time them
                self.hook_optimizer_steps(count=False)

    def _hook_module(self, module, index: int, own: list, mark: list | None) -> None:
        starts: list[int] = []
        events = self.events

        def pre(_module, _args):
            starts.append(now())
            if mark is not None:
                mark[0] = starts[-1]

        def begin_backward(_grad_outputs):
            self.bwd_start[index] = now()
            if not self.backward_began:  # the model's output node: this pre-hook ran first
                self.backward_began = self.bwd_start[index]
            self.bwd_left[index] = len(own)

        def post(_module, _args, output):
            t1 = now()
            t0 = starts.pop() if starts else t1
            if self.on:
                self.events.append(("F", index, t0, t1))
            if own and torch.is_grad_enabled():
                node = _grad_node(output)
                if node is not None:
                    node.register_prehook(begin_backward)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        for p in own:
            number = self.param_index[id(p)]

            def ready(_param, number=number):
                t = now()
                left = self.bwd_left[index] - 1
                self.bwd_left[index] = left
                if self.on:
                    events.append(("G", number, t))
                    if left == 0:
                        events.append(("B", index, self.bwd_start[index], t))

            p.register_post_accumulate_grad_hook(ready)

    def _hook_passes(self, top, model: int, genuine_ddp, root_start: list) -> None:
        starts: list[int] = []
        backward: list[int] = [0]
        unhooked = [genuine_ddp]  # its comm hook goes in at the first forward

        def end_backward():
            if self.on:
                self.events.append(("P", 1, backward[0], now()))

        def begin_backward(_grad_outputs):
            backward[0] = self.backward_began or now()
            self.backward_began = 0
            torch.autograd.Variable._execution_engine.queue_callback(end_backward)

        def pre(_module, _args):
            t = now()
            if not self.started and self.on:
                self.started = True
                self.events.append(("S", self.steps_done, t))  # warm-up 0: the run's start
            self.backward_began = 0
            if unhooked[0] is not None:
                self._hook_ddp(unhooked.pop(), model)
                unhooked.append(None)
            starts.append(now())

        def post(_module, _args, output):
            t1 = now()
            t0 = starts.pop() if starts else t1
            if self.on:
                self.events.append(("P", 0, t0, t1))
                if t0 < root_start[0] <= t1 and root_start[0] - t0 >= WAIT_MIN_NS:
                    self.events.append(("Y", t0, root_start[0]))
            if torch.is_grad_enabled():
                node = _grad_node(output)
                if node is not None:
                    node.register_prehook(begin_backward)

        top.register_forward_pre_hook(pre, prepend=True)  # around the model's own hooks, when top is the model
        top.register_forward_hook(post)

    # --- unscheduled DDP: a timing comm hook ----------------------------------------------

    def _hook_ddp(self, ddp, model: int) -> None:
        """Before the first forward: time DDP's own all-reduce (or the script's hook, which
        `register_comm_hook` now wraps) per bucket."""
        original = ddp.register_comm_hook
        ddp.register_comm_hook = lambda state, hook: original(state, self._timed(model, hook))
        builtin = ddp._register_builtin_comm_hook

        def register_builtin(comm_hook_type):
            self.meta("note", text=f"DDP builtin comm hook {comm_hook_type}: buckets not timed")
            return builtin(comm_hook_type)

        ddp._register_builtin_comm_hook = register_builtin
        if not ddp._comm_hooks:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            original(ddp.process_group, self._timed(model, allreduce_hook))

    def _timed(self, model: int, hook):
        events = self.events

        def timed_hook(state, bucket):
            t0 = now()
            future = hook(state, bucket)
            if not self.on:
                return future
            index = bucket.index()
            buffer = bucket.buffer()
            params = tuple(self.param_index.get(id(p), -1) for p in bucket.parameters())
            if self.buckets.get((model, index)) != params:
                self.buckets[(model, index)] = params
                events.append(("K", model, index, list(params)))
            step, nbytes = self.steps_done, buffer.numel() * buffer.element_size()

            def finished(fut):
                events.append(("D", model, index, step, nbytes, t0, now()))
                return fut.value()

            return future.then(finished)

        return timed_hook

    # --- bsrun's runtime (runtime.TRACE) ------------------------------------------------

    def scheduler_trace(self, rt):
        """The Scheduler's observer for one ModelRuntime; records its partitions' layout."""
        sched = self.schedulers
        self.schedulers += 1
        for handle in self.global_hooks if self.scheduled else ():
            handle.remove()  # a fallback's step timing would make this model synchronise fully
        self.global_hooks = [] if self.scheduled else self.global_hooks
        numbers = [self.param_index.get(id(p), -1) for p in rt.params]
        parts = [[part.pid, part.nbytes, [[numbers[pc.tensor], (pc.stop - pc.start) * rt.params[pc.tensor].element_size()]
                                          for pc in part.pieces]] for part in rt.partitions]
        self.meta("partitions", scheduler=sched, partitions=parts, partition=rt.config.partition,
                  credit=rt.config.credit_bytes)
        count = len(rt.partitions)
        rounds = [0] * count
        readies = [[] for _ in range(count)]  # (round, t) of each ready not finished yet
        posts = [[] for _ in range(count)]
        events = self.events

        def trace(event: str, pid: int, t: int) -> None:
            if event == "ready":
                rounds[pid] += 1
                readies[pid].append((rounds[pid], t))
            elif event == "post":
                posts[pid].append(t)
            else:
                round_, ready = readies[pid].pop(0)
                posted = posts[pid].pop(0)
                if self.on:
                    events.append(("C", sched, pid, round_, ready, posted, t))

        return trace

    def waited(self, rt, indices, began: int) -> None:
        t = now()
        if self.on and t - began >= WAIT_MIN_NS:
            self.events.append(("W", began, t, [self.param_index.get(id(rt.params[i]), -1) for i in indices]))

    def updated(self, params, began: int) -> None:
        if self.on:
            self.events.append(("U", began, now(), [self.param_index.get(id(p), -1) for p in params]))

    # --- steps --------------------------------------------------------------------------

    def on_step(self, number: int) -> None:
        t = now()
        self.steps_done = number
        if self.ended:
            return
        if number == self.warmup and not self.on:
            self.on = True
        if self.on:
            self.started = True
            self.events.append(("S", number, t))
        if self.steps is not None and number >= self.warmup + self.steps:
            self.ended = True
            self.end_job()
        self.flush()

    def hook_optimizer_steps(self, count: bool) -> None:
        """Unscheduled runs: every optimizer.step() is one update span (and, with `count`,
        one step boundary: bsrun's step listeners run only where bsrun patched torch)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        began = [0]

        def pre(_optimizer, _args, _kwargs):
            began[0] = now()

        def post(_optimizer, _args, _kwargs):
            if self.on:
                self.events.append(("U", began[0], now(), None))
            if count:
                self.on_step(self.steps_done + 1)

        self.global_hooks = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]

    def end_job(self) -> None:
        """Step WARMUP + STEPS on every rank: finish the scheduled work, meet, leave."""
        runtime = sys.modules.get("bsrun.inject.runtime")
        if runtime is not None:
            runtime.flush_all()  # the last step's transfers are still recorded
        self.on = False
        self.barrier()
        self.close()
        from bsrun.inject.trial import _hard_exit  # as a tuning trial ends: report, then leave

        watchdog = threading.Timer(EXIT_GRACE_S, _hard_exit, args=(self.rank,))
        watchdog.daemon = True
        watchdog.start()
        raise SystemExit(0)

    # --- clocks ----------------------------------------------------------------------------

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)
            return
        hvd = sys.modules.get("horovod.torch")
        if hvd is not None and hvd.is_initialized():
            hvd.barrier()

    def align_clock(self) -> None:
        """This rank's clock minus rank 0's, from the ping-pong with the shortest round trip."""
        hvd = sys.modules.get("horovod.torch")
        if not (dist.is_available() and dist.is_initialized()) and hvd is not None and hvd.is_initialized() \
                and hvd.size() > 1:
            return self._align_clock_horovod(hvd)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            self.meta("clock", offset_ns=0, rtt_ns=0, method="single process" if dist.is_available() else "none")
            return
        self.group = dist.new_group(backend="gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        stamp = torch.zeros(1, dtype=torch.int64)
        if rank == 0:
            for peer in range(1, world):
                for _ in range(CLOCK_ROUNDS):
                    dist.recv(stamp, src=peer, group=self.group)
                    stamp[0] = now()
                    dist.send(stamp, dst=peer, group=self.group)
            self.meta("clock", offset_ns=0, rtt_ns=0, method="reference")
            return
        best = None
        for _ in range(CLOCK_ROUNDS):
            t0 = now()
            stamp[0] = t0
            dist.send(stamp, dst=0, group=self.group)
            dist.recv(stamp, src=0, group=self.group)
            t3 = now()
            if best is None or t3 - t0 < best[1]:
                best = ((t0 + t3) // 2 - int(stamp[0]), t3 - t0)
        self.meta("clock", offset_ns=best[0], rtt_ns=best[1], method=f"gloo ping-pong with rank 0, best of {CLOCK_ROUNDS}")


    def _align_clock_horovod(self, hvd) -> None:
        """Horovod: rank 0 broadcasts when it sent (t0), every rank notes when it got it (t1),
        all gather when they sent (t2), rank 0 notes when it got them (t3) and broadcasts it:
        offset = ((t1 - t0) - (t3 - t2)) / 2, from the round with the shortest round trip."""
        rank, best = hvd.rank(), None
        for k in range(CLOCK_ROUNDS):
            t0 = int(hvd.broadcast(torch.tensor([now()]), root_rank=0, name=f"bsrun.clock.{k}.a")[0])
            t1 = now()
            t2s = hvd.allgather(torch.tensor([now()]), name=f"bsrun.clock.{k}.b")
            t3 = int(hvd.broadcast(torch.tensor([now()]), root_rank=0, name=f"bsrun.clock.{k}.c")[0])
            t2 = int(t2s[rank])
            rtt = (t1 - t0) + (t3 - t2)
            if rank != 0 and (best is None or rtt < best[1]):
                best = (((t1 - t0) - (t3 - t2)) // 2, rtt)
        offset, rtt = best or (0, 0)
        self.meta("clock", offset_ns=offset, rtt_ns=rtt,
                  method="reference" if rank == 0 else f"Horovod broadcasts with rank 0, best of {CLOCK_ROUNDS}")


def _watch_horovod(recorder: Recorder, hvd) -> None:
    """Horovod is given parameters, not the model: the first module a forward pass calls
    once Horovod is initialized (the outermost, the model) is watched from then on."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    def first_forward(module, _args):
        if recorder.models or not hvd.is_initialized():
            return
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            return
        handle.remove()
        from bsrun.inject import runtime

        recorder.watch(module, module, None, comm="bsrun" if runtime.runtime_of(params) else "horovod")

    handle = register_module_forward_pre_hook(first_forward)


def _watch_ddp_construction(recorder: Recorder) -> None:
    """Every DDP the script builds (bsrun's ScheduledDDP, or the genuine one) is watched."""
    cls = torch.nn.parallel.DistributedDataParallel
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        recorder.watch(self, self.module, None if hasattr(self, "_bsrun") else self)

    cls.__init__ = __init__


def install(rank: int) -> None:
    """Record this worker as BSRUN_PROFILE_* describe."""
    global RECORDER
    from bsrun.inject import runtime

    steps = worker_setting(PROFILE_STEPS_ENV)
    scheduled = SchedConfig.from_env().enabled
    RECORDER = Recorder(rank, Path(worker_setting(PROFILE_DIR_ENV)), int(worker_setting(PROFILE_WARMUP_ENV) or 0),
                        int(steps) if steps else None, scheduled)
    if scheduled:  # bsrun patched torch: its step listeners mark the steps, its runtime the rest
        runtime.TRACE = RECORDER
        runtime.STEP_LISTENERS.append(RECORDER.on_step)
    else:
        RECORDER.hook_optimizer_steps(count=True)
    _watch_ddp_construction(RECORDER)
    from bsrun.inject.bootstrap import when_imported

    when_imported("horovod.torch", lambda hvd: _watch_horovod(RECORDER, hvd))  # may still be importing
    atexit.register(RECORDER.close)
