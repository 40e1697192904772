"""Waiting for a model's gradients and applying the user's optimizer per parameter.

The training thread's half of ModelRuntime (bsrun/inject/runtime.py): `settle` is the
dependency proxy's wait (communication done, pending update and deferred zero applied),
`optimizer_step` replaces step() (update what is ready, leave the rest pending), and
`zero_grad` defers what is still in flight. The state it reads (`ready`, `done`,
`pending`, `deferred_zero`, `writeback`, `cv`) is the runtime's.
"""

from __future__ import annotations

import time

import torch

from bsrun.inject import compiled, optim, state, trap


class Updates:
    """Mixed into ModelRuntime: everything the training thread waits for and updates."""

    def in_flight(self, i: int) -> bool:
        return self.ready[i] > self.done[i]

    def wait_for(self, indices) -> None:
        with self.cv:
            while self.error is None and any(self.in_flight(i) for i in indices):
                if not self.cv.wait(timeout=self.config.timeout):
                    raise TimeoutError(state.failed(f"gradient communication made no progress for "
                                               f"{self.config.timeout:g} s; {self._waiting_on(indices)}"))
            if self.error is not None:
                raise RuntimeError(state.failed(f"gradient communication failed ({self._waiting_on(indices)}): "
                                           f"{self.error}")) from self.error

    def _waiting_on(self, indices) -> str:
        i = next((i for i in indices if self.in_flight(i)), indices[0])
        return (f"waiting for {self.names[i]} (partition {self.layout.partitions_of[i][0]}, "
                f"round {self.ready[i]}) from another rank")

    def owes_update(self, i: int) -> bool:
        return i in self.pending or i in self.deferred_zero

    def _release(self, indices) -> None:
        """Parameters with nothing owed are plain again (see bsrun/inject/trap.py)."""
        for i in indices:
            if trap.is_trapped(self.params[i]) and not (self.in_flight(i) or self.owes_update(i)
                                                        or i in self.writeback):
                trap.release(self.params[i])

    def _write_back(self, indices) -> None:
        """find_unused_parameters: the gradients of locally unused parameters, as DDP leaves them."""
        if self.writeback:
            self.unused.write_back(self.params, indices)

    @trap.internal
    def settle(self, indices) -> None:
        """Make these parameters current: communication done, update applied, zero applied."""
        if not (self.pending or self.deferred_zero or self.writeback) and not any(map(self.in_flight, indices)):
            self._release(indices)
            return
        recorder = state.recorder
        began = time.perf_counter_ns() if recorder is not None else 0
        self.wait_for(indices)
        if recorder is not None:
            recorder.waited(self, indices, began)
        with self.cv:  # with these, every other update that is ready: one optimizer call, not many
            ready = [i for i in self.pending if not self.in_flight(i)]
        self._write_back(ready + list(indices))
        self.apply_updates(ready)
        for i in ready + list(indices):
            if i in self.deferred_zero:
                optim.zero_param_grad(self.params[i], self.deferred_zero.pop(i))
        self._release(ready + list(indices))

    def apply_updates(self, indices) -> None:
        batches: dict[tuple, list] = {}
        for i in indices:
            opt, snapshot, group = self.pending.pop(i)
            batches.setdefault((id(opt), id(snapshot)), [opt, snapshot, []])[2].append((group, self.params[i]))
        for opt, snapshot, items in batches.values():
            optim.step_subset(opt, snapshot, items)

    def flush(self) -> None:
        """Everything communicated, every pending update and zero applied."""
        if self.scheduler is None and not self.pending:
            return
        self.settle(list(range(len(self.params))))

    def optimizer_step(self, optimizer, closure, number: int):
        """Replaces step() number `number`: update what is ready, leave the rest pending.
        A closure of an elementwise optimizer runs first, as torch's optimizers run it, outside
        bsrun's `internal` (the script's reads stay trapped): its forward settles layer by
        layer, its backward is scheduled, and step() returns its loss."""
        if self.on_ddp:  # DDP's reducer averaged every gradient by the backward's end
            self._before_update(optimizer, number)
            return optim.full_step(optimizer, closure)
        if not self.proxy:  # adaptation's unscheduled-like point: wait here, as DDP at its backward's end
            self.flush()
        reason = self._why_at_once(optimizer)
        if reason is not None:
            state.say_once(f"{reason} needs all gradients at once: synchronising fully at those steps")
            self._before_update(optimizer, number)
            self.flush()
            if closure is None:
                return optim.full_step(optimizer)

            def synchronised_closure():
                loss = closure()  # its backward is scheduled; the optimizer reads grads next
                self.flush()
                return loss

            return optim.full_step(optimizer, synchronised_closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._before_update(optimizer, number)
        self._step_per_parameter(optimizer)
        return loss

    @trap.internal
    def _why_at_once(self, optimizer) -> str | None:
        """Why this step cannot go per parameter, or None."""
        if self.passes_per_sync > 1:
            self.force_accumulated()
        if compiled.inside_compiled_call():
            return "a step inside a compiled call"
        return optim.why_not_elementwise(optimizer)

    @trap.internal
    def _before_update(self, optimizer, number: int) -> None:
        """This optimizer's last updates applied (a closure's forward applied most of them
        layer by layer), then the replica check of step `number - 1`."""
        mine = [i for g in optimizer.param_groups for p in g["params"] if (i := self.index.get(id(p))) is not None]
        self.settle([i for i in mine if i in self.pending])
        self.replicas.before_step(number, mine, self.params)

    @trap.internal
    def _step_per_parameter(self, optimizer) -> None:
        snapshot = optim.snapshot_groups(optimizer)
        now = []
        with self.cv:
            for g, group in enumerate(optimizer.param_groups):
                for p in group["params"]:
                    i = self.index.get(id(p))
                    if i is not None and self.in_flight(i):
                        self.pending[i] = (optimizer, snapshot, g)
                    else:
                        now.append((g, p))
        settled = [self.index[id(p)] for _, p in now if id(p) in self.index]
        self._write_back(settled)
        optim.step_subset(optimizer, snapshot, now)
        self._release(settled)

    @trap.internal
    def zero_grad(self, params, set_to_none: bool) -> None:
        """Zero now what is settled; what is still in flight is zeroed right after its update."""
        now = []
        with self.cv:
            for p in params:
                i = self.index.get(id(p))
                if i is not None and (self.in_flight(i) or i in self.pending):
                    self.deferred_zero[i] = set_to_none
                else:
                    now.append((i, p))
        settled = [i for i, _ in now if i is not None]
        self._write_back(settled)  # outside the lock: it may wait for the used map
        for _, p in now:
            optim.zero_param_grad(p, set_to_none)
        self._release(settled)
