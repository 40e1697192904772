"""The side-by-side benchmark: the same workload under each mode, on the same network.

Each (model, bandwidth, mode, repeat) is one real launch (bsrun/bench/launches.py), so a
measurement runs exactly what a user runs; `replay` is a profiled launch replayed
(bsrun/bench/replay.py). The modes of one model and bandwidth alternate (A B C A B C ...) so that drift on the
machine hits all of them alike; speed is only ever reported as a ratio within one
such group (DESIGN.md, "Measuring").

This module only launches and summarises; it never imports torch, so the process that
measures takes no CPU or memory from the workers it measures.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

from rich.table import Table

from bsrun.bench.launches import (MODES, ORDERS, SCHEDULED_MODES, RunResult, available_models, compared_warmup,
                                  launch_args, profile_for_tac, run_once, run_timeout_s)
from bsrun.bench.replay import breakdown_line, replay_once
from bsrun.errors import BsrunError
from bsrun.fsutil import atomic_write_json
from bsrun.launch.horovod import horovod_installed

__all__ = ["MODES", "available_models", "run_bench"]

# The bench's modes: the worker's, "bsrun-fixed" and "bsrun-horovod-fixed" (bsrun's
# defaults without adaptation),
# "ps" (parameter servers unscheduled: each tensor whole, as it becomes ready, no credit
# limit), "bsrun:ORDER" (bsrun with that --order) and "replay" (a profile of bsrun-fixed
# replayed under a perfect schedule: bsrun/bench/replay.py).
BENCH_MODES = (*MODES, "bsrun-fixed", "bsrun-horovod-fixed", "ps", *(f"bsrun:{o}" for o in ORDERS), "replay")
BASELINES = ("ddp", "horovod", "ps")  # each mode's speed is also given relative to these
# Below this attainable share of DDP's step a captured share divides the noise by almost
# zero (a 0.04% gain read as 37545% captured), so none is given.
MIN_ATTAINABLE = 0.01


def summarise(model: str, bandwidth: str | None, nproc: int, steps: int,
              runs: list[RunResult], modes: list[str]) -> list[dict]:
    """One record per mode: medians over all steps of all repeats, ratios within the group.

    spread is [min, max] of the per-repeat medians: how far one run can land from
    another, which is what decides whether a ratio is real. attainable_gain and captured
    are the group's shares against the bound (_shares): the most a schedule could remove
    from DDP's step, and how much of it the mode took (0: none, 1: all);
    attainable_replay and captured_replay the same against the replayed perfect schedule.
    """
    medians: dict[str, float] = {}
    records = []
    for mode in modes:
        ok = [r for r in runs if r.mode == mode and r.error is None]
        failed = [r for r in runs if r.mode == mode and r.error is not None]
        times = [t for r in ok for t in r.step_times]
        per_repeat = [statistics.median(r.step_times) for r in ok]
        median = statistics.median(times) if times else None
        mean = statistics.fmean(times) if times else None
        if median is not None:
            medians[mode] = median
        info = ok[0].info if ok else {}
        quartiles = statistics.quantiles(times, n=4) if len(times) >= 2 else None
        records.append({
            "model": model, "bandwidth": bandwidth, "mode": mode, "world_size": nproc,
            "batch": info.get("batch"), "params": info.get("params"),
            "grad_bytes": info.get("grad_bytes"),
            "median_step_s": median,
            "mean_step_s": mean,  # beside the median: bsrun's steps can alternate short and long
            "spread": [min(per_repeat), max(per_repeat)] if per_repeat else None,
            "per_repeat_median_s": per_repeat,
            "step_iqr_s": quartiles[2] - quartiles[0] if quartiles else None,
            "repeats": len(ok), "failed_repeats": len(failed), "steps": steps, "warmup": info.get("warmup"),
            "launched_as": sorted({r.launched_as for r in ok if r.launched_as}),
            "kept_points": [r.kept for r in ok if r.kept],  # adaptation's, one per repeat
            "late_decisions": [r.late_decisions for r in ok],  # adaptation's in the timed steps, per repeat
            "first_keep_steps": [r.first_keep for r in ok],  # where adaptation's first search ended, per repeat
            # rank 0's CPU seconds (all its threads) and context switches a timed step, per repeat
            "cpu_s_per_step": [r.info.get("cpu_s_per_step") for r in ok],
            "context_switches_per_step": [r.info.get("context_switches_per_step") for r in ok],
            # the bound's two parts (median over the same steps), None for the other modes
            "compute_part_s": _median_of(ok, "compute_times"), "comm_part_s": _median_of(ok, "comm_times"),
            # the replay's trust, per repeat: [profiled run's median step, its own replay] (s)
            "replay_self_check": [[r.info["profiled_step_s"], r.info["replayed_profiled_s"]] for r in ok]
                                 if mode == "replay" else None,
            "replay_breakdown": [r.info["breakdown"] for r in ok] if mode == "replay" else None,
            "errors": [r.error.splitlines()[0] for r in failed],
        })
    for rec in records:
        m = rec["median_step_s"]
        for base in BASELINES:
            rec[f"speedup_vs_{base}"] = medians[base] / m if m is not None and base in medians else None
        rec["efficiency"] = medians["bound"] / m if m is not None and "bound" in medians else None
        rec["attainable_gain"], rec["captured"] = _shares(medians, m, "bound")
        rec["attainable_replay"], rec["captured_replay"] = _shares(medians, m, "replay")
    return records


def _shares(medians: dict[str, float], median: float | None, reference: str) -> tuple[float | None, float | None]:
    """(attainable, captured) against a reference mode: (ddp - reference) / ddp, the share
    of DDP's step a schedule could remove (None without both; zero or below only when
    noise put the reference at or above ddp), and (ddp - mode) / (ddp - reference) (None
    with an attainable gain under MIN_ATTAINABLE)."""
    if not {"ddp", reference} <= medians.keys():
        return None, None
    ddp, best = medians["ddp"], medians[reference]
    gain = (ddp - best) / ddp
    return gain, (ddp - median) / (ddp - best) if gain >= MIN_ATTAINABLE and median is not None else None


def _median_of(runs: list[RunResult], key: str) -> float | None:
    values = [t for r in runs for t in r.info.get(key, [])]
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def bench_table(model: str, records: list[dict]) -> Table:
    """One table per model; rows are bandwidth x mode, a section per bandwidth (whose
    attainable gain is given once, on its first row)."""
    first = next((r for r in records if r["params"] is not None), records[0])
    title = model
    if first["params"] is not None:
        title += (f": {first['params'] / 1e6:.2f}M params, {first['grad_bytes'] / 1e6:.1f} MB "
                  f"of gradients, batch {first['batch']} per rank, {first['world_size']} ranks")
    table = Table(title=title, caption="step: median over all timed steps of all repeats; mean: their mean; "
                  "spread: min-max of per-repeat medians; step IQR: interquartile range of all the "
                  "steps (TicTac's straggler measure); efficiency: bound / mode; attainable: "
                  "(ddp - bound) / ddp, the most a schedule can take off DDP's step; captured: "
                  "(ddp - mode) / (ddp - bound); (replay): the same against the replayed perfect schedule")
    bases = [b for b in BASELINES if any(r[f"speedup_vs_{b}"] is not None for r in records)]
    replayed = any(r.get("attainable_replay") is not None for r in records)  # older records lack it
    replay_cols = ("attainable (replay)", "captured (replay)") if replayed else ()
    for col in ("bandwidth", "mode", "step (s)", "mean (s)", "spread (s)", "step IQR (s)", *(f"vs {b}" for b in bases),
                "efficiency", "attainable", "captured", *replay_cols, "repeats"):
        table.add_column(col, justify="left" if col in ("bandwidth", "mode") else "right")
    for i, r in enumerate(records):
        first = i == 0 or records[i - 1]["bandwidth"] != r["bandwidth"]
        last = i == len(records) - 1 or records[i + 1]["bandwidth"] != r["bandwidth"]
        spread = "-" if r["spread"] is None else f"{r['spread'][0]:.4g}-{r['spread'][1]:.4g}"
        repeats = f"{r['repeats']}/{r['repeats'] + r['failed_repeats']}"
        speedups = [_fmt(r[f"speedup_vs_{b}"], ".2f") + ("x" if r[f"speedup_vs_{b}"] else "") for b in bases]
        replay_cells = ((_fmt(r["attainable_replay"], ".0%") if first else "", _fmt(r["captured_replay"], ".0%"))
                        if replayed else ())
        table.add_row(r["bandwidth"] or "loopback", r["mode"], _fmt(r["median_step_s"], ".4g"),
                      _fmt(r.get("mean_step_s"), ".4g"), spread, _fmt(r["step_iqr_s"], ".3g"), *speedups, _fmt(r["efficiency"], ".2f"),
                      _fmt(r["attainable_gain"], ".0%") if first else "", _fmt(r["captured"], ".0%"),
                      *replay_cells, repeats, end_section=last and i < len(records) - 1)
    return table


def _validate(models, nproc, bandwidths, modes, steps, warmup, repeat, batch, arch, servers) -> None:
    """Every bad argument ends here in one sentence, before anything is launched."""
    bad_modes = [m for m in modes if m not in BENCH_MODES]
    if bad_modes or not modes:
        raise BsrunError(f"unknown mode(s) {', '.join(bad_modes) or '(none given)'}; "
                         f"choose from {', '.join(BENCH_MODES)}")
    if arch not in ("allreduce", "ps") or servers < 1:
        raise BsrunError("--arch must be allreduce or ps, and --servers at least 1")
    if any("horovod" in m for m in modes) and not horovod_installed():
        raise BsrunError("the horovod modes need Horovod; install it with scripts/install-horovod.sh")
    if nproc < 1 or steps < 1 or repeat < 1 or warmup < 0 or (batch is not None and batch < 1):
        raise BsrunError("-np, steps, repeat and batch must be at least 1, warmup at least 0")
    if any(b is not None for b in bandwidths):
        from bsrun.launch import netem

        for b in bandwidths:
            if b is not None:
                netem.parse_rate(b, option="--bandwidth")
        if os.geteuid() != 0:
            raise BsrunError("benchmarking on an emulated network needs root (network "
                             "namespaces and tc); run as root or leave the bandwidth out")
    known = available_models()
    unknown = [m for m in models if m not in known]
    if unknown or not models:
        raise BsrunError(f"unknown model(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(known)}")


def run_bench(models: list[str], nproc: int, bandwidths: list[str | None], modes: list[str],
              steps: int, warmup: int, repeat: int, batch: int | None, json_path: str | None,
              console, arch: str = "allreduce", servers: int = 1) -> list[dict]:
    """Run every model x bandwidth x mode `repeat` times; print tables; return the records.

    A failed run is reported with the tail of its output and the benchmark goes on. The
    JSON file (`{"results": [...]}`) is rewritten after every model and bandwidth, so an
    interrupted benchmark keeps what it measured.
    """
    models, modes, bandwidths = list(models), list(modes), list(bandwidths) or [None]
    _validate(models, nproc, bandwidths, modes, steps, warmup, repeat, batch, arch, servers)
    warmup = compared_warmup(modes, warmup)  # every mode's timed steps start at the same step
    timeout = run_timeout_s(steps, warmup)
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bsrun-bench-") as scratch:
        # Runs happen in a scratch folder: their .bsrun/ summaries do not overwrite the
        # user's, and no committed tuned config changes what is measured.
        cwd = Path(scratch)
        for model in models:
            model_records = []
            for bandwidth in bandwidths:
                label = bandwidth or "loopback"
                runs = []
                profile = None
                if "bsrun:tac" in modes:
                    with console.status(f"{model} {label}: profiling for bsrun:tac"):
                        profile = profile_for_tac(model, nproc, bandwidth, batch, cwd, arch, servers)
                for rep in range(repeat):
                    for mode in modes:
                        out = cwd / f"{model}-{label}-{mode}-{rep}.json"
                        with console.status(f"{model} {label} {mode} ({rep + 1}/{repeat})"):
                            if mode == "replay":
                                run = replay_once(model, nproc, bandwidth, steps, warmup, batch, cwd, rep)
                            else:
                                args = launch_args(model, mode, nproc, bandwidth, steps, warmup, batch, out,
                                                   arch, servers, profile)
                                run = run_once(args, mode, cwd, out, timeout)
                        runs.append(run)
                        _report_run(console, model, label, rep, repeat, run)
                group = summarise(model, bandwidth, nproc, steps, runs, modes)
                model_records += group
                results += group
                if json_path:
                    atomic_write_json(Path(json_path), {"results": results})
            console.print(bench_table(model, model_records))
            for rec in model_records:
                where = f"{model} {rec['bandwidth'] or 'loopback'} {rec['mode']}"
                for point in rec["kept_points"]:
                    console.print(f"{where}: adaptation kept {point}", highlight=False, markup=False)
                if rec["replay_breakdown"]:
                    console.print(breakdown_line(where, rec), highlight=False, markup=False)
                for rep, late in enumerate(rec["late_decisions"]):
                    for decision in late:
                        console.print(f"{where} (repeat {rep + 1}): adaptation decided inside the timed steps, "
                                      f"{decision}", highlight=False, markup=False)
                if rec["mode"] in SCHEDULED_MODES and rec["launched_as"] not in ([], ["scheduled"]):
                    console.print(f"[bold yellow]note[/bold yellow]: {model} {rec['bandwidth'] or 'loopback'} "
                                  f"bsrun ran as {'/'.join(rec['launched_as'])}, not scheduled", highlight=False)
    return results


def _report_run(console, model: str, label: str, rep: int, repeat: int, run: RunResult) -> None:
    where = f"{model} {label} {run.mode} ({rep + 1}/{repeat})"
    if run.error is None:
        console.print(f"{where}: median step {statistics.median(run.step_times):.3f} s", highlight=False)
        return
    first, _, tail = run.error.partition("\n")
    console.print(f"[bold red]{where} failed[/bold red]: {first}", highlight=False)
    if tail:
        console.print(tail, markup=False, highlight=False)
