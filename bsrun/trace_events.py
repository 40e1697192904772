"""The profile recording's format, defined once: its files, lines, event kinds and their fields.

The worker's recorder (bsrun/inject/record.py) writes it and the launcher's reader
(bsrun/profile/trace.py) reads it; both take every kind and field from here, so neither
can drift from the other. The standard library only: the reader never imports torch.

Each rank appends to `rank-<r>.jsonl`, JSON lines, each either
`{"meta": KIND, field: value, ...}` (one of META_FIELDS) or `{"events": [event, ...]}`.
An event is a JSON array: its kind's one-letter code, then its fields in order. Times
are `now()` (time.perf_counter_ns()) of the rank that recorded them; "param" numbers
are global parameter numbers (the order of the "model" lines' params), -1 for one the
recorder never saw; "module" numbers likewise for the "model" lines' modules.
"""

from __future__ import annotations

import time
from collections import namedtuple
from pathlib import Path

now = time.perf_counter_ns  # the clock of every recorded time

RANK_FILE_GLOB = "rank-*.jsonl"
META_KEY, EVENTS_KEY = "meta", "events"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank}.jsonl"


def rank_of_file(path: Path) -> int:
    return int(Path(path).stem.split("-")[-1])


# --- events: one class per kind, a namedtuple whose first field is the kind's code ------


def _kind(code: str, name: str, fields: str, doc: str):
    """A namedtuple class ("kind", *fields); built with the fields only, it fills in
    `code` and checks their number."""
    base = namedtuple(name, ("kind", *fields.split()))

    def __new__(cls, *values):
        return base.__new__(cls, code, *values)

    return type(name, (base,), {"__slots__": (), "__new__": __new__, "__doc__": doc, "CODE": code})


Forward = _kind("F", "Forward", "module start_ns end_ns",
                "a module's forward (forward pre-hook to forward hook)")
Backward = _kind("B", "Backward", "module start_ns end_ns",
                 "a layer's backward: from the moment the gradient of its output arrives (a pre-hook "
                 "on the output's grad_fn) to the moment the last of its own parameters' gradients "
                 "is accumulated")
GradReady = _kind("G", "GradReady", "param at_ns", "a parameter's gradient is ready (post-accumulate hook)")
Pass = _kind("P", "Pass", "backward start_ns end_ns", "the model's forward pass (backward 0), its backward pass (1)")
Wait = _kind("W", "Wait", "start_ns end_ns params",
             "the training thread waited for these parameters' communication (bsrun's dependency proxy)")
BufferSync = _kind("Y", "BufferSync", "start_ns end_ns",
                   "DDP's forward before the model's own: the buffer broadcast from rank 0, so mostly "
                   "waiting for the other ranks")
Update = _kind("U", "Update", "start_ns end_ns params",
               "an optimizer update of these parameters (params None: a whole optimizer.step() of an "
               "unscheduled run)")
Step = _kind("S", "Step", "number at_ns", "optimizer step `number` returned (warm-up 0: the recording's start)")
Partition = _kind("C", "Partition", "scheduler partition round ready_ns post_ns finish_ns nbytes",
                  "one partition of bsrun's scheduler in one round: ready here, handed to the backend, "
                  "finished, and the bytes its collective reduced")
Bucket = _kind("D", "Bucket", "model bucket step nbytes post_ns finish_ns",
               "one DDP bucket of an unscheduled run, timed by a comm hook that wraps DDP's own "
               "all-reduce (or the script's hook)")
BucketParams = _kind("K", "BucketParams", "model bucket params",
                     "which parameters a DDP bucket holds (recorded when it changes)")

KINDS = {k.CODE: k for k in (Forward, Backward, GradReady, Pass, Wait, BufferSync, Update, Step, Partition,
                             Bucket, BucketParams)}
# each kind's earliest time (its first field ending in _ns), by code; kinds without a time are absent
FIRST_TIME = {code: next(i for i, f in enumerate(k._fields) if f.endswith("_ns"))
              for code, k in KINDS.items() if any(f.endswith("_ns") for f in k._fields)}


def parse(event):
    """A recorded event as its kind's namedtuple; None for a kind this version does not know."""
    kind = KINDS.get(event[0]) if event else None
    return kind._make(event) if kind is not None else None


# --- meta lines --------------------------------------------------------------------------

RANK, CLOCK, MODEL, PARTITIONS, NOTE, END = "rank", "clock", "model", "partitions", "note", "end"
META_FIELDS = {
    # this rank: who, where, what it records (`config`: SchedConfig.as_dict()), its two clocks at once
    RANK: ("rank", "world_size", "pid", "host", "scheduled", "warmup", "steps", "config", "wall_ns", "clock_ns"),
    # this rank's clock minus rank 0's, the round trip it was measured in, and how
    CLOCK: ("offset_ns", "rtt_ns", "method"),
    # a model: modules [[name, type, [own param numbers]]], params [[name, numel, element size, dtype]],
    # who communicates ("bsrun", "ddp-hook", "horovod"), whether DDP broadcasts buffers each forward
    MODEL: ("model", "first_module", "first_param", "modules", "params", "comm", "sync_buffers"),
    # a scheduler: partitions [[pid, nbytes, [[param, nbytes], ...]]], the agreed partition size and credit
    PARTITIONS: ("scheduler", "partitions", "partition", "credit"),
    NOTE: ("text",),
    END: ("steps", "wall_ns"),
}


def meta_line(kind: str, **fields) -> dict:
    """One meta line; its fields must be exactly its kind's."""
    expected = META_FIELDS.get(kind)
    if expected is None or set(fields) != set(expected):
        raise ValueError(f"meta {kind!r} takes {expected}, not {tuple(fields)}")
    return {META_KEY: kind, **fields}
