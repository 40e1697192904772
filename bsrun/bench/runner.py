"""The side-by-side benchmark: the same workload under each mode, on the same network.

Each (model, bandwidth, mode, repeat) is one real launch, `bsrun ... -np N python -m
bsrun.bench.worker ...` as a child process (bsrun.child: it ends with the benchmark), so a
measurement runs exactly what a user runs. The
modes of one model and bandwidth alternate (A B C A B C ...) so that drift on the
machine hits all of them alike; speed is only ever reported as a ratio within one
such group (DESIGN.md, "Measuring").

This module only launches and summarises; it never imports torch, so the process that
measures takes no CPU or memory from the workers it measures.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table

from bsrun import child
from bsrun.errors import BsrunError
from bsrun.fsutil import atomic_write_json
from bsrun.launch.horovod import horovod_installed
from bsrun.launch.summary import decider_adaptation, rank_modes, read_last_run
from bsrun.sched.adaptive import SEARCH_STEPS, describe_point

__all__ = ["MODES", "available_models", "run_bench"]

MODES = ("ddp", "bsrun", "horovod", "bsrun-horovod", "compute", "comm", "bound", "overlap")  # the worker's
ORDERS = ("forward", "tic", "tac", "fifo")
# The bench's modes: the worker's, "bsrun-fixed" (bsrun's defaults without adaptation),
# "ps" (parameter servers unscheduled: each tensor whole, as it becomes ready, no credit
# limit), "bsrun:ORDER" (bsrun with that --order) and "replay" (a profile of bsrun-fixed
# replayed under a perfect schedule: whatif.best_schedule).
BENCH_MODES = (*MODES, "bsrun-fixed", "ps", *(f"bsrun:{o}" for o in ORDERS), "replay")
SCHEDULED_MODES = ("bsrun", "bsrun-fixed", "bsrun-horovod", "ps",
                   *(f"bsrun:{o}" for o in ORDERS))  # others: --no-schedule
ADAPTING_MODES = ("bsrun",)  # bsrun's defaults, adaptation included; other scheduled modes: --no-adapt
BASELINES = ("ddp", "horovod", "ps")  # each mode's speed is also given relative to these
PS_BASELINE = ["--order", "fifo", "--partition", "tensor"]  # and the default credit: unlimited then
TAIL_LINES = 20
STOP_GRACE_S = 30.0  # bsrun itself gives its workers 10 s, then tears the network down


def run_timeout_s(steps: int, warmup: int) -> float:
    """Generous: start-up plus 20 s a step; only a hung run should ever reach it."""
    return 120.0 + 20.0 * (steps + warmup)


@functools.cache
def available_models() -> tuple[str, ...]:
    """The worker's model names, asked from a child so this process stays torch-free."""
    proc = subprocess.run([sys.executable, "-m", "bsrun.bench.worker", "--list-models"],
                          capture_output=True, text=True, env=child.env(), timeout=120)
    if proc.returncode != 0:
        raise BsrunError(f"could not list the benchmark models: {_tail(proc.stdout + proc.stderr, 1)}")
    return tuple(proc.stdout.split())


@dataclass
class RunResult:
    """One launch: its step times (rank 0) or why it failed."""

    mode: str
    step_times: list[float] = field(default_factory=list)
    info: dict = field(default_factory=dict)  # the worker's JSON
    launched_as: str | None = None  # what the launcher's summary says the ranks ran as
    error: str | None = None
    kept: str | None = None  # the point rank 0's adaptation kept (mode bsrun)
    late_decisions: list[str] = field(default_factory=list)  # adaptation's, inside the timed steps


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    kept = text.strip().splitlines()[-lines:]
    return "\n".join(kept) if kept else "(no output)"


def arch_flags(mode: str, arch: str, servers: int, profile: Path | None = None) -> list[str]:
    """bsrun's flags for a mode: its scheduling, adaptation, order and, with --arch ps, the servers."""
    if mode not in SCHEDULED_MODES:
        return ["--no-schedule"]
    flags = ["--schedule"] if mode in ADAPTING_MODES else ["--schedule", "--no-adapt"]
    if mode == "ps" or (arch == "ps" and mode != "bsrun-horovod"):  # Horovod stays on its all-reduce
        flags += ["--arch", "ps", "--servers", str(servers)]
    if mode == "ps":
        flags += PS_BASELINE
    elif mode.startswith("bsrun:"):
        order = mode.partition(":")[2]
        flags += ["--order", f"tac:{profile}" if order == "tac" else order]
    return flags


def worker_mode(mode: str) -> str:
    """The worker builds a DDP model for every bench mode that is not its own."""
    return mode if mode in MODES else "bsrun"


def launch_args(model: str, mode: str, nproc: int, bandwidth: str | None, steps: int,
                warmup: int, batch: int | None, out: Path, arch: str = "allreduce", servers: int = 1,
                profile: Path | None = None) -> list[str]:
    """bsrun's arguments for one run; only the SCHEDULED_MODES are scheduled, only
    "bsrun" adapts, and its warm-up has SEARCH_STEPS more steps: the bench compares steady
    states, and the search's one-time cost is the adaptation's own figure."""
    args = arch_flags(mode, arch, servers, profile)
    if bandwidth is not None:
        args += ["--emulate-bandwidth", bandwidth]
    if mode == "bsrun":  # its timed steps start where its first search has settled
        warmup += SEARCH_STEPS
    args += ["-np", str(nproc), sys.executable, "-m", "bsrun.bench.worker", "--model", model,
             "--mode", worker_mode(mode), "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
    if batch is not None:
        args += ["--batch", str(batch)]
    return args


def run_once(args: list[str], mode: str, cwd: Path, out: Path, timeout: float) -> RunResult:
    """Launch `bsrun ARGS` in cwd, wait, read rank 0's result; any failure becomes RunResult.error.

    Ctrl-C stops the launch (bsrun tears down) before the caller sees it."""
    code, output = child.run(args, timeout, STOP_GRACE_S, cwd=cwd)
    if code is None:
        return RunResult(mode, error=f"did not finish in {timeout:.0f} s and was stopped\n{_tail(output)}")
    if code != 0:
        return RunResult(mode, error=f"exited with code {code}\n{_tail(output)}")
    try:
        info = json.loads(out.read_text())
        times = [float(t) for t in info["step_times"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return RunResult(mode, error=f"left no valid result in {out} ({e})\n{_tail(output)}")
    run = read_last_run(cwd)
    return RunResult(mode, times, info, "/".join(rank_modes(run)) if run else None, kept=_kept_point(run),
                     late_decisions=_late_decisions(run, info.get("warmup", 0)))


def _kept_point(run: dict | None) -> str | None:
    """From the summary bsrun leaves in its folder: the point rank 0's adaptation ended on."""
    adapt = decider_adaptation(run)
    if not adapt or adapt.get("state") == "off":
        return None
    return f"{describe_point(adapt['point'])} ({adapt['state']})"


def _late_decisions(run: dict | None, warmup: int) -> list[str]:
    """Rank 0's adaptation decisions after the warm-up (a search or a drift re-check
    among the timed steps), as `step N: why`: what a slower adaptive median may owe."""
    adapt = decider_adaptation(run) or {}
    return [f"step {d['step']}: {d['why']}" for d in adapt.get("switches", []) if d["step"] >= warmup]


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
        if median is not None:
            medians[mode] = median
        info = ok[0].info if ok else {}
        quartiles = statistics.quantiles(times, n=4) if len(times) >= 2 else None
        records.append({
            "model": model, "bandwidth": bandwidth, "mode": mode, "world_size": nproc,
            "batch": info.get("batch"), "params": info.get("params"),
            "grad_bytes": info.get("grad_bytes"),
            "median_step_s": median,
            "spread": [min(per_repeat), max(per_repeat)] if per_repeat else None,
            "per_repeat_median_s": per_repeat,
            "step_iqr_s": quartiles[2] - quartiles[0] if quartiles else None,
            "repeats": len(ok), "failed_repeats": len(failed), "steps": steps,
            "launched_as": sorted({r.launched_as for r in ok if r.launched_as}),
            "kept_points": [r.kept for r in ok if r.kept],  # adaptation's, one per repeat
            "late_decisions": [r.late_decisions for r in ok],  # adaptation's in the timed steps, per repeat
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
    without a positive attainable gain)."""
    if not {"ddp", reference} <= medians.keys():
        return None, None
    ddp, best = medians["ddp"], medians[reference]
    gain = (ddp - best) / ddp
    return gain, (ddp - median) / (ddp - best) if gain > 0 and median is not None else None


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
    table = Table(title=title, caption="step: median over all timed steps of all repeats; "
                  "spread: min-max of per-repeat medians; step IQR: interquartile range of all the "
                  "steps (TicTac's straggler measure); efficiency: bound / mode; attainable: "
                  "(ddp - bound) / ddp, the most a schedule can take off DDP's step; captured: "
                  "(ddp - mode) / (ddp - bound); (replay): the same against the replayed perfect schedule")
    bases = [b for b in BASELINES if any(r[f"speedup_vs_{b}"] is not None for r in records)]
    replayed = any(r["attainable_replay"] is not None for r in records)
    replay_cols = ("attainable (replay)", "captured (replay)") if replayed else ()
    for col in ("bandwidth", "mode", "step (s)", "spread (s)", "step IQR (s)", *(f"vs {b}" for b in bases),
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
                      spread, _fmt(r["step_iqr_s"], ".3g"), *speedups, _fmt(r["efficiency"], ".2f"),
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
    if any(m in ("horovod", "bsrun-horovod") for m in modes) and not horovod_installed():
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


def profile_args(folder: Path, model: str, mode: str, bandwidth: str | None, steps: int, warmup: int,
                 batch: int | None, out: Path, record_steps: int | None = None, nproc: int = 2,
                 arch: str = "allreduce", servers: int = 1) -> list[str]:
    """`bsrun profile` of one bench run: the same launch, recorded into `folder`."""
    profile = ["profile", "-o", str(folder), "--warmup", str(warmup)]
    if record_steps:
        profile += ["--steps", str(record_steps)]
    return profile + launch_args(model, mode, nproc, bandwidth, steps, warmup, batch, out, arch, servers)


def profile_for_tac(model: str, nproc: int, bandwidth: str | None, batch: int | None, cwd: Path,
                    arch: str, servers: int) -> Path:
    """`bsrun:tac` orders by a profile of the same job on the same network: made first,
    without adaptation (bsrun-fixed), so its recorded steps are of the configuration
    `bsrun:tac` runs, not of adaptation's trials."""
    folder = cwd / f"profile-{model}-{bandwidth or 'loopback'}"
    args = profile_args(folder, model, "bsrun-fixed", bandwidth, 100, 2, batch, cwd / "profile-run.json",
                        record_steps=4, nproc=nproc, arch=arch, servers=servers)
    code, output = child.run(args, run_timeout_s(6, 2), STOP_GRACE_S, cwd=cwd)
    if code != 0:
        raise BsrunError(f"the profile for bsrun:tac failed:\n{_tail(output)}")
    return folder


def replay_once(model: str, nproc: int, bandwidth: str | None, steps: int, warmup: int, batch: int | None,
                cwd: Path, rep: int) -> RunResult:
    """The `replay` mode: `steps` profiled steps of bsrun-fixed after `warmup`, replayed
    under a perfect schedule (whatif.best_schedule); its step times are the replay's
    steady-state ones. The info keeps how well the replay of the profiled point itself
    matched the profiled run's steps, which is how far to trust the estimate, and the
    replay's account of the gap between the two (whatif.gap_breakdown)."""
    from bsrun.profile import trace, whatif  # torch-free, but only this mode needs them

    folder = cwd / f"replay-{model}-{bandwidth or 'loopback'}-{rep}"
    args = profile_args(folder, model, "bsrun-fixed", bandwidth, steps + warmup + 1, warmup, batch,
                        cwd / "replay-run.json", record_steps=steps, nproc=nproc)
    code, output = child.run(args, run_timeout_s(steps, warmup), STOP_GRACE_S, cwd=cwd)
    if code != 0:
        ended = "did not finish" if code is None else f"exited with code {code}"
        return RunResult("replay", error=f"the profile for the replay {ended}\n{_tail(output)}")
    try:
        fitted = whatif.fit(trace.load(folder))
    except (BsrunError, ValueError, KeyError) as e:
        return RunResult("replay", error=f"the profile for the replay could not be fitted ({e})\n{_tail(output)}")
    best = whatif.best_schedule(fitted)
    breakdown = whatif.gap_breakdown(fitted)
    steady = best["step_times_s"][len(best["step_times_s"]) // 2:]
    info = {"profiled_step_s": fitted.profiled["measured_step_s"], "replayed_profiled_s": breakdown[-1][1],
            "breakdown": [list(row) for row in breakdown], "link_gbit_per_s": 8e-9 / fitted.beta if fitted.beta else None}
    return RunResult("replay", steady, info, launched_as="replayed")


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
    timeout = run_timeout_s(steps, warmup + SEARCH_STEPS)
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
                    console.print(_breakdown_line(where, rec), highlight=False, markup=False)
                for rep, late in enumerate(rec["late_decisions"]):
                    for decision in late:
                        console.print(f"{where} (repeat {rep + 1}): adaptation decided inside the timed steps, "
                                      f"{decision}", highlight=False, markup=False)
                if rec["mode"] in SCHEDULED_MODES and rec["launched_as"] not in ([], ["scheduled"]):
                    console.print(f"[bold yellow]note[/bold yellow]: {model} {rec['bandwidth'] or 'loopback'} "
                                  f"bsrun ran as {'/'.join(rec['launched_as'])}, not scheduled", highlight=False)
    return results


def _breakdown_line(where: str, rec: dict) -> str:
    """The replay's account of the gap from a perfect schedule to bsrun-fixed's point,
    each figure the median over the repeats."""
    rows = zip(*rec["replay_breakdown"])
    parts = [f"{rows_of[0][0]} {statistics.median(s for _, s in rows_of):.3f}" for rows_of in rows]
    measured = statistics.median(m for m, _ in rec["replay_self_check"])
    return f"{where}, from a perfect schedule to bsrun-fixed's point: {', '.join(parts)} s; measured {measured:.3f} s"


def _report_run(console, model: str, label: str, rep: int, repeat: int, run: RunResult) -> None:
    where = f"{model} {label} {run.mode} ({rep + 1}/{repeat})"
    if run.error is None:
        console.print(f"{where}: median step {statistics.median(run.step_times):.3f} s", highlight=False)
        return
    first, _, tail = run.error.partition("\n")
    console.print(f"[bold red]{where} failed[/bold red]: {first}", highlight=False)
    if tail:
        console.print(tail, markup=False, highlight=False)
