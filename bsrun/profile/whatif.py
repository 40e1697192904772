"""What-if: predict the step time of another config from one profile.

`fit(trace)` reduces a profile to a `Model`: per rank, the compute of an average
iteration as positions on its own compute clock (where each layer's forward starts,
where each parameter's gradient is ready in the backward pass, and the compute before,
between and after the passes, with waits and updates taken out); an update cost
(a + b * bytes per optimizer call, least squares over the recorded updates); and an
alpha-beta model of the link, t = alpha + beta * bytes per collective, least squares
over the link's busy periods (bsrun/sched/link.py: runs of overlapping transfers, which
gloo's connection serves as one FIFO stream). For scheduled runs also the decision
latency: how long after a partition was ready on every rank (and the credit allowed) it
was posted.

`predict(model, partition_bytes, credit_bytes, scheduled)` replays a few iterations of
compute and communication, event by event, and returns the steady-state step time (s):

- scheduled (bsrun): partitions from bsrun.sched.partition.plan_partitions in the
  forward pass's first-use order (an embedding table that a scheduled profile saw sent by
  its rows: whole, of the bytes it sent); a partition is issued when it is ready on every
  rank (plus the decision latency) by the scheduler's own rule (task.next_to_issue: most
  urgent first, while the bytes in flight stay within the credit, each partition charged
  as task.credit_charges charges it); transfers share one
  link, in issue order; each layer's next forward waits for its own partitions and
  applies the updates that are ready (the dependency proxy); step() updates what arrived.
- unscheduled (DDP): DDP's buckets (bsrun.sched.partition.ddp_buckets) in the order
  gradients became ready, each all-reduced once it and the ones before it are ready on every rank; the
  backward pass ends by waiting for every bucket, then one full optimizer step.

Between modes the compute changes by what communication running beside it costs (CPU:
the network stack, gloo's threads, packing), a constant per gradient tensor measured on
this machine (OVERLAP_S_PER_TENSOR): DDP sends nearly all of it after the backward pass,
a schedule during it. Ranks that broadcast buffers before each forward (DDP's default,
with BatchNorm) start each forward together.

A pure function of the Model: the tuner can call it for any number of candidates. Not
modelled: how the CPU that communication takes from computation changes with the
partition size or bandwidth (compute is as profiled), rank skew beyond the per-rank
compute times, and a table's rows in a replay of an unscheduled profile (sent dense).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace

from bsrun.profile.analysis import (RankView, clip, dense_bytes_if_by_rows, forward_order, iterations, rank_views,
                                   tables_by_rows, total)
from bsrun.sched import link, task
from bsrun.sched.partition import TensorInfo, ddp_buckets, plan_partitions

# What overlapped communication costs the compute per gradient tensor and iteration.
# Measured on this machine as the compute of a bsrun profile less that of a DDP profile of
# the same job: ResNet-50 (161 tensors) 54 and 36 ms at 1 and 3 Gbit/s (BENCHMARKS.md).
# It is the overlap, not bsrun's Python: with one 64 MB partition sent after the backward
# pass, as DDP sends, bsrun's compute was DDP's (519 against 522 ms at 1 Gbit/s, sixth pass),
# and bsrun's hooks take about 10 ms a step (cProfile). Any schedule that overlaps pays it, so
# the perfect schedule keeps it. A constant: one profile cannot tell it from the layers' own.
OVERLAP_S_PER_TENSOR = 0.28e-3
REPLAY_ITERATIONS = 8
# best_schedule's partitions: fine enough that priority is as good as preemptive (2 ms at
# 1 Gbit/s), coarse enough that the replay of a 100 MB model stays under a second.
PERFECT_PARTITION = 256 * 2**10


@dataclass
class RankCompute:
    """One rank's average iteration on its own compute clock, in seconds."""

    before_forward: float            # step() return -> forward pass (data, zero_grad, ...)
    forward: float                   # the forward pass's compute
    forward_at: dict[str, float]     # layer -> where its forward starts within it
    before_backward: float           # forward end -> backward start (the loss)
    backward: float
    ready_at: dict[str, float]       # parameter -> when its gradient is ready within the backward
    after_backward: float            # backward end -> step() return, less waits and updates


@dataclass
class Model:
    world_size: int
    params: list[dict]               # name, numel, element_size, dtype (sent_bytes: a table's); registration order
    layer_params: dict[str, list[str]]
    forward_layers: list[str]        # first-use order
    ranks: list[RankCompute]
    alpha: float                     # s per collective
    beta: float                      # s per byte
    update_a: float                  # s per optimizer call
    update_b: float                  # s per byte updated
    decision: float                  # s from ready everywhere (and credit) to posted
    sync_forward: bool               # DDP's forward broadcasts buffers first: the ranks meet there
    overlap_cost: float              # s of compute per iteration that overlapped communication costs
    profiled: dict = field(default_factory=dict)  # scheduled, partition, credit, measured step (s)

    def as_dict(self) -> dict:
        return asdict(self)


# --- fitting ------------------------------------------------------------------------------


def least_squares(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """y = a + b x, with a >= 0 and b >= 0 (through the origin when a would be negative)."""
    if len(set(xs)) > 1:
        b, a = statistics.linear_regression(xs, ys)
        if a >= 0 and b >= 0:
            return a, b
    sxy, sxx = sum(x * y for x, y in zip(xs, ys)), sum(x * x for x in xs)
    if sxx > 0 and sxy > 0:
        return 0.0, sxy / sxx
    return (max(0.0, statistics.fmean(ys)), 0.0) if xs else (0.0, 0.0)


def _collectives(views: list[RankView], partition_bytes: int) -> list[dict]:
    """Each collective as all ranks saw it (matched by name and round): bytes sent, credit
    charge, ready on every rank, posted on every rank, finished (mean), in issue order."""
    by_key: dict = {}
    for v in views:
        for t in v.transfers:
            key = (t.name, t.args.get("round", t.args.get("step")))
            by_key.setdefault(key, []).append(t)
    out = []
    for ts in by_key.values():
        if len(ts) != len(views):
            continue
        nbytes, dense = ts[0].args.get("bytes", 0), dense_bytes_if_by_rows(ts[0])
        out.append({"bytes": nbytes, "charge": task.credit_charge(dense or nbytes, bool(dense), partition_bytes),
                    "ready": max(t.args["ready_us"] for t in ts) / 1e6,
                    "posted": max(t.args["post_us"] for t in ts) / 1e6,
                    "finished": statistics.fmean(t.args["finish_us"] for t in ts) / 1e6})
    out.sort(key=lambda c: c["posted"])
    return out


def fit_link(collectives: list[dict]) -> tuple[float, float]:
    """(alpha, beta); (0, 0) when the transfers are too few to fit."""
    return link.fit([(c["bytes"], c["posted"], c["finished"]) for c in collectives], fixed_if_unknown=0.0) \
        or (0.0, 0.0)


def fit_decision(collectives: list[dict], credit: int) -> float:
    """Median delay of a post after it was possible: ready everywhere and within the credit."""
    delays = []
    for i, c in enumerate(collectives):
        allowed = c["ready"]
        earlier = sorted(collectives[:i], key=lambda e: e["finished"])
        in_flight = [e for e in earlier if e["finished"] > allowed]
        while in_flight and sum(e["charge"] for e in in_flight) + c["charge"] > credit:
            allowed = in_flight.pop(0)["finished"]
        delays.append(max(0.0, c["posted"] - allowed))
    return statistics.median(delays) if delays else 0.0


def _rank_compute(view: RankView, scheduled: bool) -> RankCompute | None:
    figures = []
    for lo, hi, _ in view.windows():
        fwd = [s for s in view.forward_passes if lo <= s.t0 < hi]
        if not fwd:
            continue
        f = fwd[0]
        bwd = [s for s in view.backward_passes if f.t1 <= s.t0 < hi]
        if not bwd:
            continue
        b = bwd[0]

        def compute_in(a, z):  # time in [a, z] not waiting and not updating
            return (z - a) - total(clip(view.wait_intervals, a, z)) - total(clip(view.update_intervals, a, z))

        forward_at = {}
        for layer, spans in view.forward.items():
            first = [s for s in spans if f.t0 <= s.t0 <= f.t1]
            if first and layer in view.layer_of.values():
                forward_at[layer] = compute_in(f.t0, first[0].t0) / 1e6
        ready_at = {}
        for param, times in view.grads.items():
            mine = [t for t in times if b.t0 <= t <= b.t1 + 1e3]
            if mine:
                ready_at[param] = (mine[0] - b.t0) / 1e6
        comm_wait = 0.0
        if not scheduled:  # DDP waits for its buckets at the end of the backward pass
            finishes = [t.args["finish_us"] for t in view.transfers if b.t0 <= t.args["post_us"] <= hi]
            comm_wait = max(0.0, min(hi, max(finishes, default=b.t1)) - b.t1)
        figures.append(RankCompute(compute_in(lo, f.t0) / 1e6, compute_in(f.t0, f.t1) / 1e6, forward_at,
                                   max(0.0, b.t0 - f.t1) / 1e6, (b.t1 - b.t0) / 1e6, ready_at,
                                   max(0.0, compute_in(b.t1, hi) - comm_wait) / 1e6))
    if not figures:
        return None

    def mean_of(dicts):
        keys = set().union(*dicts)
        return {k: statistics.fmean(d[k] for d in dicts if k in d) for k in keys}

    return RankCompute(statistics.fmean(x.before_forward for x in figures), statistics.fmean(x.forward for x in figures),
                       mean_of([x.forward_at for x in figures]), statistics.fmean(x.before_backward for x in figures),
                       statistics.fmean(x.backward for x in figures), mean_of([x.ready_at for x in figures]),
                       statistics.fmean(x.after_backward for x in figures))


def _update_fit(views: list[RankView], params: list[dict]) -> tuple[float, float]:
    everything = sum(p["bytes"] for p in params)
    xs, ys = [], []
    for v in views:
        for u in v.updates:
            xs.append(float(everything if u.args.get("params") == "all" else u.args.get("bytes", 0)))
            ys.append((u.t1 - u.t0) / 1e6)
    return least_squares(xs, ys)


def fit(trace: dict) -> Model:
    """The what-if model of a profile (see the module's docstring)."""
    views = rank_views(trace)
    if not views or not views[0].meta.get("params"):
        raise ValueError("the profile recorded no model (no DDP model was built)")
    meta = views[0].meta
    scheduled = meta.get("comm") == ["bsrun"]
    ranks = [c for v in views if (c := _rank_compute(v, scheduled)) is not None]
    if not ranks:
        raise ValueError("the profile holds no complete iteration (a forward and a backward pass between two steps)")
    config = meta.get("config") or {}
    collectives = _collectives(views, config.get("partition") or 0)
    alpha, beta = fit_link(collectives)
    credit = config.get("credit_bytes") or 0
    decision = fit_decision(collectives, credit) if scheduled else alpha
    rows = iterations(views)
    steps = [r["step_ms"] / 1e3 for r in rows]
    update_a, update_b = _update_fit(views, meta["params"])
    overlap_cost = OVERLAP_S_PER_TENSOR * len(meta["params"])
    tables = tables_by_rows(views[0], meta["params"])
    params = [{**p, "sent_bytes": tables[p["name"]]} if p["name"] in tables else p for p in meta["params"]]
    return Model(len(views), params, {l["name"]: l["params"] for l in meta["layers"]}, forward_order(views[0]),
                 ranks, alpha, beta, update_a, update_b, decision,
                 bool(meta.get("sync_buffers")), overlap_cost,
                 {"scheduled": scheduled, "partition": config.get("partition"), "credit": credit,
                  "credit_spec": config.get("credit"), "transfers": len(collectives),
                  "measured_step_s": statistics.median(steps) if steps else None})


# --- replay ------------------------------------------------------------------------------


def _issue_round(ready: dict[int, float], sizes: list[int], charges: list[int], credit: int, alpha: float,
                 beta: float, decision: float, link_free: float) -> dict[int, float]:
    """Finish time of each partition of one round under the scheduler's issue rule: `sizes`
    the bytes each sends, `charges` what each holds of the credit."""
    known = {p: t + decision for p, t in ready.items()}
    finish: dict[int, float] = {}
    t = min(known.values())
    while len(finish) < len(known):
        candidates = {p for p, k in known.items() if p not in finish and k <= t}
        in_flight = sum(charges[p] for p, f in finish.items() if f > t)
        p = task.next_to_issue(candidates, in_flight, charges, credit)
        if p is not None:
            start = max(t, link_free)
            link_free = finish[p] = start + alpha + beta * sizes[p]
            continue
        later = [k for p, k in known.items() if p not in finish and k > t] + [f for f in finish.values() if f > t]
        t = min(later)
    return finish


def _forward(rank: RankCompute, begin: float, layer_deps: dict[str, set[int]], done_at: dict[int, float],
             pending: set[int], model: Model, update_bytes: list[int]) -> float:
    """A rank's forward pass from `start`: before each layer, wait for its partitions still
    pending and apply every pending update that has arrived (bsrun's dependency proxy)."""
    t, consumed = begin, 0.0
    for layer in sorted(rank.forward_at, key=rank.forward_at.get):
        t += rank.forward_at[layer] - consumed
        consumed = rank.forward_at[layer]
        deps = [g for g in layer_deps.get(layer, []) if g in pending]
        if deps:
            t = max(t, max(done_at[g] for g in deps))
            arrived = [g for g in pending if done_at[g] <= t]
            t += model.update_a + model.update_b * sum(update_bytes[g] for g in arrived)
            pending.difference_update(arrived)
    return t + rank.forward - consumed


def layout(model: Model, partition_bytes: int, scheduled: bool) -> tuple[list[list[int]], list[int], list[int]]:
    """(parameters of each collective, the bytes it sends, its credit charge): bsrun's
    partitions or DDP's buckets."""
    params = model.params
    if not scheduled:
        r0 = model.ranks[0]
        ready_order = sorted(range(len(params)), key=lambda i: r0.ready_at.get(params[i]["name"], float("inf")))
        buckets = [[ready_order[k] for k in b] for b in ddp_buckets([params[i]["bytes"] for i in ready_order])]
        sizes = [sum(params[i]["bytes"] for i in b) for b in buckets]
        return buckets, sizes, sizes
    index = {p["name"]: i for i, p in enumerate(params)}
    first_use = [index[n] for layer in model.forward_layers for n in model.layer_params.get(layer, []) if n in index]
    order = task.forward_order(first_use, [p["name"] for p in params])
    infos = [TensorInfo(p["numel"], p["element_size"], p["dtype"], int("sent_bytes" in p)) for p in params]
    parts = plan_partitions(infos, order, partition_bytes)
    return ([sorted({pc.tensor for pc in part.pieces}) for part in parts],
            [params[part.pieces[0].tensor]["sent_bytes"] if part.rows else part.nbytes for part in parts],
            task.credit_charges(parts, partition_bytes))


def _scaled(rank: RankCompute, factor: float) -> RankCompute:
    return RankCompute(rank.before_forward * factor, rank.forward * factor,
                       {k: v * factor for k, v in rank.forward_at.items()}, rank.before_backward * factor,
                       rank.backward * factor, {k: v * factor for k, v in rank.ready_at.items()},
                       rank.after_backward * factor)


def compute_for(model: Model, scheduled: bool) -> list[RankCompute]:
    """Each rank's compute under the mode replayed: as profiled, less or plus the cost of
    overlapped communication when the profile and the replay differ in mode (stretched evenly)."""
    change = model.overlap_cost * (int(scheduled) - int(bool(model.profiled.get("scheduled"))))
    out = []
    for rank in model.ranks:
        measured = rank.before_forward + rank.forward + rank.before_backward + rank.backward + rank.after_backward
        out.append(_scaled(rank, (measured + change) / measured) if change and measured > 0 else rank)
    return out


def _read_by(layer: str, ran: dict[str, float]) -> str:
    """The layer whose forward reads `layer`'s parameters: itself if it ran, else its nearest
    enclosing layer that did (nn.MultiheadAttention reads its never-called out_proj's
    weight; under bsrun that read waits for it)."""
    module = layer
    while module and module not in ran:
        module = module.rpartition(".")[0]
    return module or layer


def predict_detail(model: Model, partition_bytes: int, credit_bytes: int, scheduled: bool,
                   iterations: int = REPLAY_ITERATIONS) -> dict:
    """The replay: rank 0's step times, iteration by iteration, and their steady-state median."""
    params = model.params
    ranks = compute_for(model, scheduled)
    groups, sizes, charges = layout(model, partition_bytes, scheduled)
    index = {p["name"]: i for i, p in enumerate(params)}
    group_of: dict[int, list[int]] = {}
    for g, members in enumerate(groups):
        for i in members:
            group_of.setdefault(i, []).append(g)
    layer_deps: dict[str, set[int]] = {}
    for layer, names in model.layer_params.items():
        layer_deps.setdefault(_read_by(layer, ranks[0].forward_at), set()).update(
            g for n in names if n in index for g in group_of.get(index[n], []))
    done_at = {g: 0.0 for g in range(len(groups))}
    pending: list[set[int]] = [set() for _ in ranks]
    starts = [0.0] * len(ranks)
    boundaries: list[list[float]] = [[0.0] for _ in ranks]
    link_free = 0.0
    for _ in range(iterations):
        ends, ready = [], {}
        begins = [start + rank.before_forward for start, rank in zip(starts, ranks)]
        if model.sync_forward:  # the buffer broadcast: every rank starts with the last one
            begins = [max(begins)] * len(begins)
        for r, rank in enumerate(ranks):
            t = _forward(rank, begins[r], layer_deps, done_at, pending[r], model, sizes)
            b0 = t + rank.before_backward
            for g, members in enumerate(groups):
                at = max(rank.ready_at.get(params[i]["name"], rank.backward) for i in members)
                ready[g] = max(ready.get(g, 0.0), b0 + at)
            ends.append(b0 + rank.backward)
        if scheduled:
            done_at = _issue_round(ready, sizes, charges, credit_bytes, model.alpha, model.beta, model.decision,
                                   link_free)
        else:
            done_at, posted = {}, 0.0
            for g in range(len(groups)):  # in order: a bucket goes once it and those before are ready
                posted = max(posted, ready[g])
                start = max(posted + model.decision, link_free)
                link_free = done_at[g] = start + model.alpha + model.beta * sizes[g]
        link_free = max(done_at.values(), default=link_free)
        for r, rank in enumerate(ranks):
            t = ends[r]
            if scheduled:  # step(): update what has arrived, leave the rest to the next forward
                arrived = [g for g in done_at if done_at[g] <= t]
                if arrived:
                    t += model.update_a + model.update_b * sum(sizes[g] for g in arrived)
                pending[r] = set(done_at) - set(arrived)
            else:  # DDP: the backward pass ends when every bucket is in; one full step
                t = max(t, link_free) + model.update_a + model.update_b * sum(sizes)
            starts[r] = t + rank.after_backward
            boundaries[r].append(starts[r])
    steps = [b - a for a, b in zip(boundaries[0], boundaries[0][1:])]
    return {"step_s": statistics.median(steps[len(steps) // 2:]), "step_times_s": steps,
            "collectives": len(groups), "bytes": sum(sizes)}


def predict(model: Model, partition_bytes: int, credit_bytes: int, scheduled: bool) -> float:
    """Predicted steady-state step time (s) of the profiled job under this config."""
    return predict_detail(model, partition_bytes, credit_bytes, scheduled)["step_s"]


def best_schedule(model: Model) -> dict:
    """The replay under a perfect schedule: no cost per collective, no decision latency,
    strict priority by first use
    (PERFECT_PARTITION partitions, one in flight). What no schedule changes stays as
    profiled: each rank's compute (with the CPU the overlapped communication took from it),
    the link's bandwidth, and the dependencies (a gradient goes once it is ready everywhere
    and is waited for where the next forward first uses it). So it estimates what any
    schedule could reach on this job, where the bench's `bound` (the larger of compute and
    communication, each alone) charges neither the dependencies nor the contention. An
    estimate, not a proof: it carries the replay's own error."""
    perfect = replace(model, alpha=0.0, decision=0.0)
    return predict_detail(perfect, PERFECT_PARTITION, PERFECT_PARTITION, scheduled=True)


def gap_breakdown(model: Model, perfect_s: float | None = None) -> list[tuple[str, float]]:
    """From the perfect schedule to the replay of a scheduled profile's own point, one cost
    added back at a time: (what was added, replayed step s). Where the gap between a
    perfect schedule and bsrun goes, by the replay's account. `perfect_s`: best_schedule's
    step when the caller has it (it is the slowest replay here)."""
    if not model.profiled.get("scheduled"):
        raise ValueError("a breakdown needs a profile of a scheduled run")
    partition, credit = model.profiled["partition"] or 1, model.profiled["credit"] or 1
    if perfect_s is None:
        perfect_s = best_schedule(model)["step_s"]
    return [("a perfect schedule", perfect_s),
            ("+ the profiled partitions and credit", predict(replace(model, alpha=0.0, decision=0.0),
                                                             partition, credit, True)),
            ("+ the fixed cost per collective", predict(replace(model, decision=0.0), partition, credit, True)),
            ("+ the decision latency (the profiled point)", predict(model, partition, credit, True))]
