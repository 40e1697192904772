"""The ranks' recordings -> one Chrome trace (Perfetto, chrome://tracing).

Each rank wrote `rank-<r>.jsonl` (bsrun/inject/record.py, in the format of
bsrun/trace_events.py, whose kinds and fields this reads). Here they become one
`trace.json`: a process per rank, named threads for compute (forward and backward spans
per module, the passes, waits, step marks, gradient-ready marks), communication (each
partition's or bucket's transfer), the communication queue (how long each waited between
ready and posted: async slices) and updates; `distributedInfo` as torch.profiler writes
it; and under "bsrun" what the analysis needs (modules, parameters, clock offsets, config).

Times: each rank's clock minus its measured offset to rank 0, in microseconds from the
first event of the run. A transfer's slice on the communication thread is the time the
link worked on it: from when it was posted, or when the one before it finished if that
was later, to when it finished (so slices never overlap); its args keep the raw ready,
posted and finished times.

The reader skips a line that a killed worker left half-written, so whatever was
recorded before Ctrl-C still makes a valid trace.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

from bsrun import trace_events as ev
from bsrun.errors import BsrunError
from bsrun.fsutil import atomic_write_text

TRACE_FILE = "trace.json"
COMPUTE, COMM, QUEUE, UPDATES = 1, 2, 3, 4
THREADS = {COMPUTE: "compute", COMM: "communication", QUEUE: "comm queue", UPDATES: "updates"}
COMM_KIND = {"bsrun": "bsrun scheduler (partitions)",
             "ddp-hook": "DDP buckets, timed by a comm hook around DDP's all-reduce (bsrun not scheduling)",
             "horovod": "not recorded (Horovod's own DistributedOptimizer, bsrun not scheduling)"}


@dataclass
class RankRecording:
    rank: int
    info: dict = field(default_factory=dict)
    clock: dict = field(default_factory=lambda: {"offset_ns": 0, "rtt_ns": 0, "method": "none"})
    models: list[dict] = field(default_factory=list)
    partitions: dict[int, dict] = field(default_factory=dict)
    events: list[list] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ended: dict | None = None
    bad_lines: int = 0


def read_rank_file(path: Path) -> RankRecording:
    rec = RankRecording(ev.rank_of_file(path))
    with open(path) as f:
        for line in f:
            try:
                obj = json.loads(line)
            except ValueError:
                rec.bad_lines += 1  # cut short by a kill: everything before it stands
                continue
            kind = obj.get(ev.META_KEY)
            if kind is None:
                rec.events.extend(obj.get(ev.EVENTS_KEY, []))
            elif kind == ev.RANK:
                rec.info = obj
            elif kind == ev.CLOCK:
                rec.clock = obj
            elif kind == ev.MODEL:
                rec.models.append(obj)
            elif kind == ev.PARTITIONS:
                rec.partitions[obj["scheduler"]] = obj
            elif kind == ev.NOTE:
                rec.notes.append(obj["text"])
            elif kind == ev.END:
                rec.ended = obj
    return rec


def read_recordings(folder: Path) -> list[RankRecording]:
    paths = sorted(Path(folder).glob(ev.RANK_FILE_GLOB), key=ev.rank_of_file)
    return [read_rank_file(p) for p in paths]


class _Names:
    """Module and parameter names of one rank (global numbers, as the recorder gave them)."""

    def __init__(self, models: list[dict]):
        self.modules: list[str] = []
        self.params: list[dict] = []
        self.layers: list[dict] = []
        prefix_models = len(models) > 1
        for m in models:
            prefix = f"m{m['model']}/" if prefix_models else ""
            for name, numel, size, dtype in m["params"]:
                self.params.append({"name": prefix + name, "numel": numel, "bytes": numel * size,
                                    "element_size": size, "dtype": dtype})
            for name, kind, own in m["modules"]:
                self.modules.append(prefix + name)
                if own:
                    self.layers.append({"name": prefix + name, "type": kind,
                                        "params": [self.params[p]["name"] for p in own],
                                        "numel": sum(self.params[p]["numel"] for p in own),
                                        "bytes": sum(self.params[p]["bytes"] for p in own)})

    def param(self, number: int) -> str:
        return self.params[number]["name"] if 0 <= number < len(self.params) else f"param{number}"


def _span(name, cat, tid, rank, t0, t1, args=None) -> dict:
    event = {"ph": "X", "name": name, "cat": cat, "pid": rank, "tid": tid, "ts": t0, "dur": max(0.0, t1 - t0)}
    if args:
        event["args"] = args
    return event


def _instant(name, cat, tid, rank, t, scope="t", args=None) -> dict:
    event = {"ph": "i", "s": scope, "name": name, "cat": cat, "pid": rank, "tid": tid, "ts": t}
    if args:
        event["args"] = args
    return event


def _rank_events(rec: RankRecording, base_ns: int) -> list[dict]:
    names = _Names(rec.models)
    offset = rec.clock.get("offset_ns", 0)
    r = rec.rank

    def us(t):
        return round((t - offset - base_ns) / 1000.0, 3)

    out: list[dict] = []
    grads: dict[int, list[int]] = {}
    transfers = []  # (post_ns, finish_ns, ready_ns | None, name, args)
    layout: dict[tuple[int, int], list[int]] = {}
    for e in map(ev.parse, rec.events):
        if isinstance(e, (ev.Forward, ev.Backward)):
            module = names.modules[e.module] if e.module < len(names.modules) else f"module{e.module}"
            if isinstance(e, ev.Forward):
                out.append(_span(module, "forward", COMPUTE, r, us(e.start_ns), us(e.end_ns), {"module": module}))
            else:
                out.append(_span(f"{module} bwd", "backward", COMPUTE, r, us(e.start_ns), us(e.end_ns),
                                 {"module": module}))
        elif isinstance(e, ev.GradReady):
            grads.setdefault(e.param, []).append(e.at_ns)
            out.append(_instant("grad ready", "grad", COMPUTE, r, us(e.at_ns), args={"param": names.param(e.param)}))
        elif isinstance(e, ev.Pass):
            out.append(_span("backward pass" if e.backward else "forward pass", "pass", COMPUTE, r, us(e.start_ns),
                             us(e.end_ns)))
        elif isinstance(e, ev.Wait):
            out.append(_span("wait for comm", "wait", COMPUTE, r, us(e.start_ns), us(e.end_ns),
                             {"params": [names.param(p) for p in e.params]}))
        elif isinstance(e, ev.BufferSync):
            out.append(_span("DDP forward sync (buffer broadcast)", "wait", COMPUTE, r, us(e.start_ns), us(e.end_ns),
                             {"params": []}))
        elif isinstance(e, ev.Update):
            if e.params is None:
                out.append(_span("optimizer.step", "update", UPDATES, r, us(e.start_ns), us(e.end_ns),
                                 {"params": "all"}))
            else:
                out.append(_span("update", "update", UPDATES, r, us(e.start_ns), us(e.end_ns),
                                 {"params": [names.param(p) for p in e.params],
                                  "bytes": sum(names.params[p]["bytes"] for p in e.params
                                               if 0 <= p < len(names.params))}))
        elif isinstance(e, ev.Step):
            out.append(_instant(f"step {e.number}", "step", COMPUTE, r, us(e.at_ns), scope="p",
                                args={"step": e.number}))
        elif isinstance(e, ev.Partition):
            part = rec.partitions.get(e.scheduler, {}).get("partitions", [])
            pieces = part[e.partition][2] if e.partition < len(part) else []
            name = f"p{e.partition}" if len(rec.partitions) < 2 else f"s{e.scheduler}p{e.partition}"
            transfers.append((e.post_ns, e.finish_ns, e.ready_ns, name,
                              {"partition": e.partition, "scheduler": e.scheduler, "round": e.round, "bytes": e.nbytes,
                               "pieces": [[names.param(p), b] for p, b in pieces]}))
        elif isinstance(e, ev.BucketParams):
            layout[(e.model, e.bucket)] = e.params
        elif isinstance(e, ev.Bucket):
            params = layout.get((e.model, e.bucket), [])
            ready = [ts[i - 1] for p in params
                     if (ts := grads.get(p)) and (i := bisect.bisect_right(ts, e.post_ns)) > 0]
            transfers.append((e.post_ns, e.finish_ns, max(ready) if ready else None, f"bucket {e.bucket}",
                              {"bucket": e.bucket, "model": e.model, "step": e.step, "bytes": e.nbytes,
                               "pieces": [[names.param(p), names.params[p]["bytes"]] for p in params
                                          if 0 <= p < len(names.params)]}))
    transfers.sort(key=lambda t: (t[1], t[0]))
    link_free = None
    for n, (post, finish, ready, name, args) in enumerate(transfers):
        start = post if link_free is None else max(post, link_free)
        link_free = finish
        ready = post if ready is None or ready > post else ready
        args.update(ready_us=us(ready), post_us=us(post), finish_us=us(finish),
                    queue_ms=round((post - ready) / 1e6, 4), in_flight_ms=round((finish - post) / 1e6, 4))
        out.append(_span(name, "transfer", COMM, r, us(start), us(finish), args))
        ident = f"{r}.{name}.{args.get('round', args.get('step'))}.{n}"
        out.append({"ph": "b", "cat": "queue", "name": f"{name} queued", "id": ident, "pid": r, "tid": QUEUE,
                    "ts": us(ready)})
        out.append({"ph": "e", "cat": "queue", "name": f"{name} queued", "id": ident, "pid": r, "tid": QUEUE,
                    "ts": us(post)})
    return out


def _first_time(rec: RankRecording) -> int | None:
    times = [e[ev.FIRST_TIME[e[0]]] for e in rec.events if e[0] in ev.FIRST_TIME]
    return min(times) - rec.clock.get("offset_ns", 0) if times else None


def build_trace(recordings: list[RankRecording], run: dict | None = None) -> dict:
    """One Chrome trace of every rank's recording; `run`: the launch (command, exit code)."""
    if not recordings:
        raise BsrunError("no rank recorded anything (was the job a PyTorch script launched by bsrun?)")
    firsts = [t for t in map(_first_time, recordings) if t is not None]
    base = min(firsts) if firsts else 0
    events: list[dict] = []
    ranks_meta = {}
    for rec in recordings:
        r = rec.rank
        comm = sorted({m["comm"] for m in rec.models})
        events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
        for tid, label in THREADS.items():
            events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": label}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": tid, "args": {"sort_index": tid}})
        events.extend(_rank_events(rec, base))
        names = _Names(rec.models)
        ranks_meta[str(r)] = {
            "clock_offset_us": rec.clock.get("offset_ns", 0) / 1000.0,
            "clock_rtt_us": rec.clock.get("rtt_ns", 0) / 1000.0,
            "clock_method": rec.clock.get("method"),
            "scheduled": rec.info.get("scheduled"),
            "config": rec.info.get("config"),
            "communication": [COMM_KIND.get(c, c) for c in comm] or ["not recorded (no DDP model seen)"],
            "comm": comm,
            "sync_buffers": any(m.get("sync_buffers") for m in rec.models),
            "layers": names.layers,
            "params": names.params,
            "partition_layout": {str(s): {"partition": m.get("partition"), "credit": m.get("credit"),
                                          "sizes": [p[1] for p in m["partitions"]]}
                                 for s, m in rec.partitions.items()},
            "notes": rec.notes,
            "complete": rec.ended is not None,
            "steps": (rec.ended or {}).get("steps"),
            "unreadable_lines": rec.bad_lines,
        }
    first = recordings[0].info
    world = first.get("world_size", len(recordings))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "distributedInfo": {"backend": "gloo", "rank": 0, "world_size": world, "ranks": [r.rank for r in recordings]},
        "bsrun": {"version": 1, "world_size": world, "warmup": first.get("warmup"), "steps": first.get("steps"),
                  "base_ns": base, "ranks": ranks_meta, "run": run or {}},
    }


def write_trace(folder: Path, trace: dict) -> Path:
    path = Path(folder) / TRACE_FILE
    atomic_write_text(path, json.dumps(trace, separators=(",", ":")))
    return path


def merge(folder: Path, run: dict | None = None) -> dict:
    """Read the ranks' recordings in `folder` and write its trace.json; return the trace."""
    trace = build_trace(read_recordings(folder), run)
    write_trace(folder, trace)
    return trace


def load(folder: Path) -> dict:
    """The trace of a profile folder (merged again from the ranks' files if it has none)."""
    folder = Path(folder)
    path = folder / TRACE_FILE
    if not folder.is_dir():
        raise BsrunError(f"no profile folder {folder}")
    if not path.exists():
        if not list(folder.glob(ev.RANK_FILE_GLOB)):
            raise BsrunError(f"{folder} holds neither {TRACE_FILE} nor rank recordings")
        return merge(folder)
    try:
        trace = json.loads(path.read_text())
        trace["traceEvents"], trace["bsrun"]["ranks"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BsrunError(f"{path} is not a bsrun profile trace ({e})") from None
    return trace
