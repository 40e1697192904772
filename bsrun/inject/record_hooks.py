"""Hooks that time one model's modules, parameters and passes for the profile recorder.

`ModelHooks.watch` numbers a model's modules and parameters (the "model" meta line says
which is which) and hooks them, recording:

- Forward: a forward pre-hook and a forward hook on every module;
- Backward: a layer (a module owning parameters) starts when the gradient of its output
  arrives (a pre-hook on the output's grad_fn) and ends when the last of its own
  parameters' gradients is accumulated (post-accumulate hooks, which record GradReady);
- Pass: the model's forward, and its backward up to autograd's end-of-pass callback;
- BufferSync: DDP's own forward before the model's (its buffer broadcast);
- Step 0: the run's first boundary, at the first forward when there is no warm-up.
"""

from __future__ import annotations

import torch

from bsrun.inject import record_ddp
from bsrun.trace_events import MODEL, Backward, BufferSync, Forward, GradReady, Pass, Step, now

WAIT_MIN_NS = 20_000  # shorter "waits" are the dependency proxy finding nothing to wait for


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


class ModelHooks:
    """The module and parameter numbering of one recorder, and the hooks of its models."""

    def __init__(self, recorder):
        self.rec = recorder
        self.models = 0
        self.modules = 0
        self.bwd_start: list[int] = []  # per module number: when its backward began
        self.bwd_left: list[int] = []   # its own parameters' gradients still to come
        self.backward_began = 0         # a layer's backward began before the pass's own hook

    def watch(self, top: torch.nn.Module, root: torch.nn.Module, genuine_ddp, comm: str) -> None:
        """Number and hook `root`'s modules and parameters; `top` (the DDP wrapper, or the
        model) gives the passes; `genuine_ddp`: an unscheduled DDP whose buckets are timed."""
        rec = self.rec
        model = self.models
        self.models += 1
        first_param = len(rec.param_index)
        params = []
        for name, p in root.named_parameters():
            if p.requires_grad and id(p) not in rec.param_index:
                rec.param_index[id(p)] = first_param + len(params)
                params.append([name, p.numel(), p.element_size(), str(p.dtype).removeprefix("torch.")])
        modules = []
        owned_seen: set[int] = set()
        root_start = [0]  # when the model's own forward began (after DDP's buffer broadcast)
        for name, module in root.named_modules():
            own = [rec.param_index[id(p)] for p in module._parameters.values()
                   if p is not None and id(p) in rec.param_index and id(p) not in owned_seen]
            owned_seen.update(id(p) for p in module._parameters.values() if p is not None)
            index = self.modules + len(modules)
            modules.append([name or type(root).__name__, type(module).__name__, own])
            self.bwd_start.append(0)
            self.bwd_left.append(0)
            self._hook_module(module, index, [p for p in module._parameters.values()
                                              if p is not None and id(p) in rec.param_index
                                              and rec.param_index[id(p)] in own],
                              root_start if module is root else None)
        self.modules += len(modules)
        sync = top is not root and any(True for _ in root.buffers()) and bool(
            getattr(top, "forward_sync_buffers", getattr(top, "broadcast_buffers", False)))
        rec.meta(MODEL, model=model, first_module=self.modules - len(modules), first_param=first_param,
                 modules=modules, params=params, comm=comm, sync_buffers=sync)
        self._hook_passes(top, model, genuine_ddp, root_start)

    def _hook_module(self, module, index: int, own: list, mark: list | None) -> None:
        rec = self.rec
        starts: list[int] = []
        events = rec.events

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
            if rec.on:
                events.append(Forward(index, t0, t1))
            if own and torch.is_grad_enabled():
                node = _grad_node(output)
                if node is not None:
                    node.register_prehook(begin_backward)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        for p in own:
            number = rec.param_index[id(p)]

            def ready(_param, number=number):
                t = now()
                left = self.bwd_left[index] - 1
                self.bwd_left[index] = left
                if rec.on:
                    events.append(GradReady(number, t))
                    if left == 0:
                        events.append(Backward(index, self.bwd_start[index], t))

            p.register_post_accumulate_grad_hook(ready)

    def _hook_passes(self, top, model: int, genuine_ddp, root_start: list) -> None:
        rec = self.rec
        starts: list[int] = []
        backward: list[int] = [0]
        unhooked = [genuine_ddp]  # its comm hook goes in at the first forward
        events = rec.events

        def end_backward():
            if rec.on:
                events.append(Pass(1, backward[0], now()))

        def begin_backward(_grad_outputs):
            backward[0] = self.backward_began or now()
            self.backward_began = 0
            torch.autograd.Variable._execution_engine.queue_callback(end_backward)

        def pre(_module, _args):
            t = now()
            if not rec.started and rec.on:
                rec.started = True
                events.append(Step(rec.steps_done, t))  # warm-up 0: the run's start
            self.backward_began = 0
            if unhooked[0] is not None:
                record_ddp.time_buckets(rec, unhooked.pop(), model)
                unhooked.append(None)
            starts.append(now())

        def post(_module, _args, output):
            t1 = now()
            t0 = starts.pop() if starts else t1
            if rec.on:
                events.append(Pass(0, t0, t1))
                if t0 < root_start[0] <= t1 and root_start[0] - t0 >= WAIT_MIN_NS:
                    events.append(BufferSync(t0, root_start[0]))
            if torch.is_grad_enabled():
                node = _grad_node(output)
                if node is not None:
                    node.register_prehook(begin_backward)

        top.register_forward_pre_hook(pre, prepend=True)  # around the model's own hooks, when top is the model
        top.register_forward_hook(post)
