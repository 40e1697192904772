"""The in-worker recorder of `bsrun profile`: one rank's events, written a step at a time.

Installed by the bootstrap when BSRUN_PROFILE_DIR is set: the construction hooks at torch's
import (`install_hooks`), the recorder itself when the process becomes a worker (`start`,
from the bootstrap's on-worker callback). Every rank appends to
`rank-<r>.jsonl` in that folder, in the format bsrun/trace_events.py defines: meta lines
(this rank, its clock offset, a model's modules and parameters, a scheduler's
partitions) and event lines (everything recorded since the last line, written at each
optimizer step and at exit). An interrupted run loses at most the step in progress, and
a line cut short by a kill is skipped by the reader (bsrun/profile/trace.py), which
merges the ranks into one Chrome trace.

Who records what: record_hooks.py the modules, parameters and passes of every model
(DDP's constructor, or the first forward under Horovod); record_ddp.py an unscheduled
DDP's buckets; this module bsrun's scheduler (its observer: Partition), the training
thread's waits (Wait) and updates (Update), and the steps (Step). clock.py measures
the clock offset when the first model is seen (the same point on every rank).

Recording starts after WARMUP optimizer steps; with STEPS set, every rank ends the job at
step WARMUP + STEPS (bsrun/inject/ending.py: the scheduled work is finished, so the last
step's transfers are recorded, the ranks meet, the file is closed, and SystemExit(0)
leaves the script's `finally` blocks and atexit handlers to run).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from pathlib import Path

import torch

from bsrun.config import PROFILE_DIR_ENV, PROFILE_STEPS_ENV, PROFILE_WARMUP_ENV, worker_setting
from bsrun.inject import clock, ending, state
from bsrun.inject.import_hook import when_imported
from bsrun.inject.record_hooks import WAIT_MIN_NS, ModelHooks
from bsrun.trace_events import (CLOCK, END, EVENTS_KEY, PARTITIONS, RANK, Partition, Step, Update, Wait,
                                meta_line, now, rank_file_name)

TRIM_EVENTS = 100_000     # written events kept in memory before the list is cut


class Recorder:
    """One rank's recording: its events in memory, its file, and the steps that frame it."""

    def __init__(self, rank: int, folder: Path, warmup: int, steps: int | None, scheduled: bool):
        self.rank, self.warmup, self.steps, self.scheduled = rank, warmup, steps, scheduled
        self.file = open(Path(folder) / rank_file_name(rank), "w")
        self.lock = threading.Lock()          # one writer at a time
        self.events: list[tuple] = []         # appended from any thread (list.append is atomic)
        self.written = 0
        self.on = warmup == 0
        self.steps_done = 0
        self.started = False                  # the first boundary has been recorded
        self.param_index: dict[int, int] = {}  # id(parameter) -> global parameter number
        self.hooks = ModelHooks(self)
        self.schedulers = 0
        self.global_hooks = []
        self.ended = False
        self.meta(RANK, rank=rank, world_size=state.world_size() or 1, pid=os.getpid(),
                  host=socket.gethostname(), scheduled=scheduled, warmup=warmup, steps=steps,
                  config=state.config().as_dict(), wall_ns=time.time_ns(), clock_ns=now())

    # --- writing ----------------------------------------------------------------------

    def _write(self, obj) -> None:
        self.file.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self.file.flush()

    def meta(self, kind: str, **fields) -> None:
        line = meta_line(kind, **fields)
        with self.lock:
            if not self.file.closed:
                self._write(line)

    def flush(self) -> None:
        with self.lock:
            n = len(self.events)
            if n > self.written and not self.file.closed:
                self._write({EVENTS_KEY: self.events[self.written:n]})
            self.written = n
            if self.written > TRIM_EVENTS:
                del self.events[:self.written]
                self.written = 0

    def close(self) -> None:
        self.flush()
        self.meta(END, steps=self.steps_done, wall_ns=time.time_ns())
        with self.lock:
            self.file.close()

    # --- models -------------------------------------------------------------------------

    @property
    def models(self) -> int:
        return self.hooks.models

    def watch(self, top, root, genuine_ddp, comm: str | None = None) -> None:
        """Record `root`'s modules and parameters and `top`'s passes (record_hooks.py);
        `genuine_ddp`: an unscheduled DDP whose buckets a comm hook times; `comm`: who
        communicates (default: bsrun, or the DDP hook)."""
        if self.models == 0:
            self.meta(CLOCK, **clock.measure())
        self.hooks.watch(top, root, genuine_ddp, comm or ("bsrun" if genuine_ddp is None else "ddp-hook"))
        if genuine_ddp is not None and self.scheduled and not self.global_hooks and not state.MODELS:
            self.hook_optimizer_steps(count=False)  # a fallback: its optimizer steps are whole, time them

    # --- bsrun's runtime (state.recorder) ---------------------------------------------------

    def scheduler_trace(self, rt):
        """The Scheduler's observer for one ModelRuntime; records its partitions' layout."""
        sched = self.schedulers
        self.schedulers += 1
        for handle in self.global_hooks if self.scheduled else ():
            handle.remove()  # a fallback's step timing would make this model synchronise fully
        self.global_hooks = [] if self.scheduled else self.global_hooks
        numbers = [self.param_index.get(id(p), -1) for p in rt.params]
        sizes = [p.element_size() for p in rt.params]
        parts = [[part.pid, part.nbytes, [[numbers[pc.tensor], (pc.stop - pc.start) * sizes[pc.tensor]]
                                          for pc in part.pieces]] for part in rt.partitions]
        self.meta(PARTITIONS, scheduler=sched, partitions=parts, partition=rt.partition_bytes, credit=rt.credit_bytes)
        count = len(rt.partitions)
        rounds = [0] * count
        readies = [[] for _ in range(count)]  # (round, t) of each ready not finished yet
        posts = [[] for _ in range(count)]
        events = self.events

        def trace(event: str, pid: int, t: int, nbytes: int) -> None:
            if event == "ready":
                rounds[pid] += 1
                readies[pid].append((rounds[pid], t))
            elif event == "post":
                posts[pid].append(t)
            else:
                round_, ready = readies[pid].pop(0)
                posted = posts[pid].pop(0)
                if self.on:
                    events.append(Partition(sched, pid, round_, ready, posted, t, nbytes))

        return trace

    def waited(self, rt, indices, began: int) -> None:
        t = now()
        if self.on and t - began >= WAIT_MIN_NS:
            self.events.append(Wait(began, t, [self.param_index.get(id(rt.params[i]), -1) for i in indices]))

    def updated(self, params, began: int) -> None:
        if self.on:
            self.events.append(Update(began, now(), [self.param_index.get(id(p), -1) for p in params]))

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
            self.events.append(Step(number, t))
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
                self.events.append(Update(began[0], now(), None))
            if count:
                self.on_step(self.steps_done + 1)

        self.global_hooks = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]

    def end_job(self) -> None:
        """Step WARMUP + STEPS on every rank: the scheduled work finished (and recorded),
        the ranks met, then recording stops and the file closes; raises SystemExit(0)."""

        def last_words():
            self.on = False
            self.close()

        ending.end_job(self.rank, last_words)


def _watch_horovod(hvd) -> None:
    """Horovod is given parameters, not the model: the first module a forward pass calls
    once Horovod is initialized and this process records (the outermost, the model) is
    watched from then on."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    def first_forward(module, _args):
        recorder = state.recorder
        if recorder is None or recorder.models or not hvd.is_initialized():
            return
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            return
        handle.remove()
        recorder.watch(module, module, None, comm="bsrun" if state.model_of(params) else "horovod")

    handle = register_module_forward_pre_hook(first_forward)


def _watch_ddp_construction() -> None:
    """Every DDP the script builds (bsrun's ScheduledDDP, or the genuine one) is watched, once
    it is built: building it made this process a worker, and so its recorder."""
    cls = torch.nn.parallel.DistributedDataParallel
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if state.recorder is not None:
            state.recorder.watch(self, self.module, None if hasattr(self, "_bsrun") else self)

    cls.__init__ = __init__


def install_hooks() -> None:
    """At torch's import, after bsrun's patches (BSRUN_PROFILE_DIR set): the construction
    hooks, which record only once `start` made this process's recorder."""
    _watch_ddp_construction()
    when_imported("horovod.torch", _watch_horovod)  # may still be importing


def start(rank: int) -> None:
    """Record this worker as BSRUN_PROFILE_* describe (it just became a worker)."""
    if state.recorder is not None:
        return
    steps = worker_setting(PROFILE_STEPS_ENV)
    scheduled = state.config().enabled
    recorder = Recorder(rank, Path(worker_setting(PROFILE_DIR_ENV)), int(worker_setting(PROFILE_WARMUP_ENV) or 0),
                        int(steps) if steps else None, scheduled)
    state.recorder = recorder
    if scheduled:  # bsrun patched torch: its step listeners mark the steps, its runtime the rest
        state.STEP_LISTENERS.append(recorder.on_step)
    else:
        recorder.hook_optimizer_steps(count=True)
    atexit.register(recorder.close)
