"""Times an unscheduled DDP's buckets for the profile recorder, with a comm hook around its own.

When bsrun does not schedule a DDP model, its communication is DDP's: per bucket, the
all-reduce its default comm hook (or the script's own hook) starts. The timing hook
wraps that hook unchanged, so the model computes exactly what it would unprofiled, and
records a Bucket (posted when the hook ran, finished when its future completed) and,
when a bucket's parameters change, BucketParams.
"""

from __future__ import annotations

from bsrun.trace_events import NOTE, Bucket, BucketParams, now


def time_buckets(rec, ddp, model: int) -> None:
    """Before the first forward: time DDP's own all-reduce (or the script's hook, which
    `register_comm_hook` now wraps) per bucket of `ddp`, the recorder's model `model`."""
    layouts: dict[int, tuple] = {}  # bucket index -> its parameter numbers, as last recorded
    original = ddp.register_comm_hook
    ddp.register_comm_hook = lambda state, hook: original(state, _timed(rec, model, layouts, hook))
    builtin = ddp._register_builtin_comm_hook

    def register_builtin(comm_hook_type):
        rec.meta(NOTE, text=f"DDP builtin comm hook {comm_hook_type}: buckets not timed")
        return builtin(comm_hook_type)

    ddp._register_builtin_comm_hook = register_builtin
    if not ddp._comm_hooks:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        original(ddp.process_group, _timed(rec, model, layouts, allreduce_hook))


def _timed(rec, model: int, layouts: dict, hook):
    events = rec.events

    def timed_hook(state, bucket):
        t0 = now()
        future = hook(state, bucket)
        if not rec.on:
            return future
        index = bucket.index()
        buffer = bucket.buffer()
        params = tuple(rec.param_index.get(id(p), -1) for p in bucket.parameters())
        if layouts.get(index) != params:
            layouts[index] = params
            events.append(BucketParams(model, index, list(params)))
        step, nbytes = rec.steps_done, buffer.numel() * buffer.element_size()

        def finished(fut):
            events.append(Bucket(model, index, step, nbytes, t0, now()))
            return fut.value()

        return future.then(finished)

    return timed_hook
