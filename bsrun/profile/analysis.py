"""A profile's trace -> where each iteration's time went, per iteration and per layer.

An iteration is the time between two consecutive optimizer step() returns of a rank.
Within it:

- compute: the forward pass, the backward pass and the optimizer updates, less the
  time the training thread waited for communication inside them;
- comm: the time the link worked on transfers (the communication thread's slices);
- overlap: the part of comm during compute, as HTA defines it (overlap % = overlap / comm);
- exposed comm: comm not hidden by compute; idle: the iteration less compute (waits for
  communication, for the other ranks, data loading, anything outside the passes);
- bound: max(compute, comm), the best any overlap could do (DESIGN.md); efficiency =
  bound / iteration.

Per layer (a module that owns parameters): its forward and backward spans, and its share
(by bytes) of each partition or bucket holding its gradients: transfer time, time queued
between ready and posted, and transfer time not hidden by compute. Ranks are averaged.
Times are in ms.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

# --- intervals: sorted, disjoint lists of (start, end) ---------------------------------


def union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def intersect(xs, ys) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(xs, ys) -> list[tuple[float, float]]:
    out = []
    for a, b in xs:
        for c, d in ys:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def total(intervals) -> float:
    return sum(b - a for a, b in intervals)


def clip(intervals, lo: float, hi: float) -> list[tuple[float, float]]:
    return intersect(intervals, [(lo, hi)])


# --- one rank's view of the trace ---------------------------------------------------


@dataclass
class Span:
    name: str
    t0: float  # µs
    t1: float
    args: dict = field(default_factory=dict)


@dataclass
class RankView:
    rank: int
    meta: dict
    boundaries: list[tuple[float, int]] = field(default_factory=list)  # (ts, step number)
    forward_passes: list[Span] = field(default_factory=list)
    backward_passes: list[Span] = field(default_factory=list)
    forward: dict[str, list[Span]] = field(default_factory=dict)
    backward: dict[str, list[Span]] = field(default_factory=dict)
    waits: list[Span] = field(default_factory=list)
    updates: list[Span] = field(default_factory=list)
    transfers: list[Span] = field(default_factory=list)
    grads: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self):
        self.layer_of = {p: layer["name"] for layer in self.meta.get("layers", []) for p in layer["params"]}

    def finish(self) -> None:
        for spans in (self.forward_passes, self.backward_passes, self.waits, self.updates, self.transfers):
            spans.sort(key=lambda s: s.t0)
        self.boundaries.sort()
        self.wait_intervals = union((s.t0, s.t1) for s in self.waits)
        self.update_intervals = union((s.t0, s.t1) for s in self.updates)
        busy = union([(s.t0, s.t1) for s in self.forward_passes + self.backward_passes + self.updates])
        self.compute = subtract(busy, self.wait_intervals)
        self.comm = union((s.t0, s.t1) for s in self.transfers)

    def windows(self) -> list[tuple[float, float, int]]:
        """(start, end, step number) of each recorded iteration."""
        return [(a, b, n) for (a, _), (b, n) in zip(self.boundaries, self.boundaries[1:])]

    def shares(self, transfer: Span) -> dict[str, float]:
        """Each layer's fraction (by bytes) of one transfer."""
        nbytes = transfer.args.get("bytes") or sum(b for _, b in transfer.args.get("pieces", [])) or 1
        out: dict[str, float] = {}
        for param, b in transfer.args.get("pieces", []):
            layer = self.layer_of.get(param, param)
            out[layer] = out.get(layer, 0.0) + b / nbytes
        return out


def rank_views(trace: dict) -> list[RankView]:
    ranks = trace["bsrun"]["ranks"]
    views = {int(r): RankView(int(r), meta) for r, meta in ranks.items()}
    for e in trace["traceEvents"]:
        view = views.get(e.get("pid"))
        if view is None or e.get("ph") not in ("X", "i"):
            continue
        cat, args = e.get("cat"), e.get("args", {})
        if e["ph"] == "i":
            if cat == "step":
                view.boundaries.append((e["ts"], args.get("step")))
            elif cat == "grad":
                view.grads.setdefault(args["param"], []).append(e["ts"])
            continue
        span = Span(e["name"], e["ts"], e["ts"] + e["dur"], args)
        if cat == "forward":
            view.forward.setdefault(args.get("module", e["name"]), []).append(span)
        elif cat == "backward":
            view.backward.setdefault(args.get("module", e["name"]), []).append(span)
        elif cat == "pass":
            (view.forward_passes if e["name"].startswith("forward") else view.backward_passes).append(span)
        elif cat == "wait":
            view.waits.append(span)
        elif cat == "update":
            view.updates.append(span)
        elif cat == "transfer":
            view.transfers.append(span)
    for view in views.values():
        view.finish()
    return [views[r] for r in sorted(views)]


# --- per iteration ---------------------------------------------------------------------


def iteration_figures(view: RankView, lo: float, hi: float) -> dict:
    compute = clip(view.compute, lo, hi)
    comm = clip(view.comm, lo, hi)
    step = hi - lo
    c, m = total(compute), total(comm)
    overlap = total(intersect(comm, compute))
    bound = max(c, m)
    return {"step_ms": step / 1e3, "compute_ms": c / 1e3, "comm_ms": m / 1e3,
            "overlap_pct": 100.0 * overlap / m if m else 0.0, "exposed_comm_ms": (m - overlap) / 1e3,
            "idle_ms": (step - c) / 1e3, "bound_ms": bound / 1e3, "efficiency": bound / step if step else 0.0}


ITERATION_KEYS = ("step_ms", "compute_ms", "comm_ms", "overlap_pct", "exposed_comm_ms", "idle_ms", "bound_ms",
                  "efficiency")
LAYER_KEYS = ("forward_ms", "backward_ms", "comm_ms", "queue_ms", "exposed_comm_ms")


def backward_end(view: RankView, lo: float, hi: float) -> float | None:
    """When the iteration's last backward pass ended (None: none in it)."""
    ends = [s.t1 for s in view.backward_passes if lo < s.t1 <= hi]
    return max(ends) if ends else None


def iterations(views: list[RankView]) -> list[dict]:
    """Per recorded iteration: the figures averaged over ranks (and each rank's); the
    slowest rank's compute: a synchronous step waits for that rank whatever the schedule;
    and the rank lag, how far apart (ms, on rank 0's clock) the ranks' backward passes
    ended: the earlier rank's last gradients wait that long for the other's."""
    windows = {v.rank: {n: (a, b) for a, b, n in v.windows()} for v in views}
    per_rank = {v.rank: {n: iteration_figures(v, a, b) for n, (a, b) in windows[v.rank].items()} for v in views}
    steps = sorted(set().union(*(set(d) for d in per_rank.values()))) if per_rank else []
    rows = []
    for n in steps:
        figures = [d[n] for d in per_rank.values() if n in d]
        row = {"step": n, **{k: statistics.fmean(f[k] for f in figures) for k in ITERATION_KEYS}}
        row["slowest_compute_ms"] = max(f["compute_ms"] for f in figures)
        ends = [e for v in views if n in windows[v.rank] and (e := backward_end(v, *windows[v.rank][n])) is not None]
        row["rank_lag_ms"] = (max(ends) - min(ends)) / 1e3 if ends else 0.0
        row["per_rank"] = {r: d[n] for r, d in per_rank.items() if n in d}
        rows.append(row)
    return rows


def median_row(rows: list[dict]) -> dict:
    keys = (*ITERATION_KEYS, "slowest_compute_ms", "rank_lag_ms")
    return {k: statistics.median(r[k] for r in rows) for k in keys} if rows else {}


# --- per layer ------------------------------------------------------------------------------


def _rounds(view: RankView, lo: float, hi: float) -> dict:
    """The transfers of each communication round that became ready in [lo, hi]; only
    complete rounds (as many transfers as the fullest round)."""
    rounds: dict = {}
    for t in view.transfers:
        if lo <= t.args.get("ready_us", t.t0) <= hi:
            rounds.setdefault(t.args.get("round", t.args.get("step")), []).append(t)
    most = max((len(ts) for ts in rounds.values()), default=0)
    return {k: ts for k, ts in rounds.items() if len(ts) == most}


def dense_bytes_if_by_rows(transfer: Span) -> int:
    """A transfer that sent an embedding table by its rows (bsrun/sched/row_sparse.py): one
    piece, fewer bytes sent than it holds -> the piece's bytes; any other transfer -> 0."""
    pieces = transfer.args.get("pieces") or []
    return pieces[0][1] if len(pieces) == 1 and transfer.args.get("bytes", 0) < pieces[0][1] else 0


def tables_by_rows(view: RankView, params: list[dict]) -> dict[str, float]:
    """Embedding tables sent by their rows -> median bytes sent a round."""
    whole = {p["name"]: p["bytes"] for p in params}
    sent: dict[str, list[int]] = {}
    for t in view.transfers:
        if (dense := dense_bytes_if_by_rows(t)) and dense == whole.get(name := t.args["pieces"][0][0]):
            sent.setdefault(name, []).append(t.args["bytes"])
    return {name: statistics.median(b) for name, b in sent.items()}


def layer_figures(view: RankView) -> dict[str, dict]:
    if len(view.boundaries) < 2:
        return {}
    lo, hi = view.boundaries[0][0], view.boundaries[-1][0]
    count = len(view.boundaries) - 1
    out = {layer["name"]: {"forward_ms": 0.0, "backward_ms": 0.0, "comm_ms": 0.0, "queue_ms": 0.0,
                           "exposed_comm_ms": 0.0} for layer in view.meta.get("layers", [])}
    for kind, spans_of in (("forward_ms", view.forward), ("backward_ms", view.backward)):
        for module, spans in spans_of.items():
            if module in out:
                out[module][kind] = sum(s.t1 - s.t0 for s in spans if lo <= s.t0 < hi) / count / 1e3
    rounds = _rounds(view, lo, hi)
    for transfers in rounds.values():
        for t in transfers:
            exposed = total(subtract([(t.t0, t.t1)], view.compute))
            queue = t.args.get("post_us", t.t0) - t.args.get("ready_us", t.t0)
            for layer, share in view.shares(t).items():
                if layer in out:
                    out[layer]["comm_ms"] += share * (t.t1 - t.t0) / len(rounds) / 1e3
                    out[layer]["queue_ms"] += share * queue / len(rounds) / 1e3
                    out[layer]["exposed_comm_ms"] += share * exposed / len(rounds) / 1e3
    return out


def forward_order(view: RankView) -> list[str]:
    """Layers in the order the forward pass first ran them (others after, as declared)."""
    first = {m: min(s.t0 for s in spans) for m, spans in view.forward.items() if spans}
    names = [layer["name"] for layer in view.meta.get("layers", [])]
    return sorted(names, key=lambda n: (n not in first, first.get(n, 0.0), names.index(n)))


def layers(views: list[RankView]) -> list[dict]:
    if not views:
        return []
    per_rank = [layer_figures(v) for v in views]
    meta = {layer["name"]: layer for layer in views[0].meta.get("layers", [])}
    rows = []
    for name in forward_order(views[0]):
        figures = [f[name] for f in per_rank if name in f]
        row = {"name": name, "type": meta[name]["type"], "params": meta[name]["numel"], "bytes": meta[name]["bytes"]}
        row.update({k: statistics.fmean(f[k] for f in figures) if figures else 0.0 for k in LAYER_KEYS})
        rows.append(row)
    return rows


# --- everything -----------------------------------------------------------------------------


def analyse(trace: dict) -> dict:
    """The summary of a profile: what summary.json holds and the tables show."""
    views = rank_views(trace)
    rows = iterations(views)
    layer_rows = layers(views)
    meta = trace["bsrun"]
    rank0 = meta["ranks"].get("0") or next(iter(meta["ranks"].values()), {})
    summary = {
        "world_size": meta.get("world_size"),
        "ranks": sorted(int(r) for r in meta["ranks"]),
        "config": rank0.get("config"),
        "scheduled": any(v.meta.get("comm") == ["bsrun"] for v in views),
        "communication": rank0.get("communication"),
        "clock_offsets_us": {r: m.get("clock_offset_us") for r, m in meta["ranks"].items()},
        "complete": all(m.get("complete") for m in meta["ranks"].values()),
        "iterations": rows,
        "median": median_row(rows),
        "layers": layer_rows,
        "layer_totals": {k: sum(r[k] for r in layer_rows) for k in ("params", "bytes", *LAYER_KEYS)},
        "notes": sorted({n for m in meta["ranks"].values() for n in m.get("notes", [])}),
    }
    if not rows:
        summary["notes"].append("fewer than two step boundaries were recorded: no iteration to analyse "
                                "(did the job run past the warm-up steps?)")
    return summary
