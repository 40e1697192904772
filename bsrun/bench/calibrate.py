"""How far to trust `bsrun profile`: its recording overhead, and what-if against measurement.

    python -m bsrun.bench.calibrate overhead --model resnet50 --bandwidth none --repeat 3
    python -m bsrun.bench.calibrate whatif --model vgg16 --bandwidth 1gbit,3gbit

overhead: the bench worker (bsrun/bench/worker.py) launched alternately with and without
`bsrun profile` (recording every step), scheduled and not; the step times are the
worker's own (rank 0, between step ends, after its warm-up), so the ratio is the cost of
recording.

whatif: for each model and bandwidth, `bsrun bench --modes ddp,bsrun` measures both
modes; one profile of each mode is taken on the same emulated network; from each profile
both modes are predicted (`whatif.predict`) and compared with the measured medians.

Both print a table and write JSON (--json FILE). They launch real jobs, as the benchmark
does (run_once): run them on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from rich.table import Table

from bsrun.bench.launches import compared_warmup, launch_args, profile_args, run_once, run_timeout_s
from bsrun.bench.runner import run_bench
from bsrun.console import new_console
from bsrun.fsutil import atomic_write_json
from bsrun.profile import trace, whatif


def plain_args(model, mode, bandwidth, steps, warmup, batch, out) -> list[str]:
    return launch_args(model, mode, 2, bandwidth, steps, warmup, batch, out)


def overhead(models, bandwidth, modes, steps, warmup, repeat, batch, console) -> list[dict]:
    rows = []
    warmup = compared_warmup(modes, warmup)  # an adapting mode is timed (and recorded) after its first search
    with tempfile.TemporaryDirectory(prefix="bsrun-calibrate-") as scratch:
        cwd = Path(scratch)
        for model in models:
            for mode in modes:
                times = {"plain": [], "profiled": []}
                for rep in range(repeat):
                    for kind in ("plain", "profiled"):
                        out = cwd / f"{model}-{mode}-{kind}-{rep}.json"
                        args = (plain_args(model, mode, bandwidth, steps, warmup, batch, out) if kind == "plain"
                                else profile_args(cwd / f"prof-{model}-{mode}-{rep}", model, mode, bandwidth,
                                                  steps, warmup, batch, out))
                        run = run_once(args, mode, cwd, out, run_timeout_s(steps, warmup))
                        if run.error:
                            console.print(f"{model} {mode} {kind}: {run.error}", markup=False)
                            continue
                        times[kind].append(statistics.median(run.step_times))
                        console.print(f"{model} {mode} {kind} ({rep + 1}/{repeat}): "
                                      f"{times[kind][-1]:.4f} s", highlight=False)
                if times["plain"] and times["profiled"]:
                    plain, profiled = statistics.median(times["plain"]), statistics.median(times["profiled"])
                    rows.append({"model": model, "mode": mode, "bandwidth": bandwidth, "plain_s": plain,
                                 "profiled_s": profiled, "overhead_pct": 100 * (profiled / plain - 1),
                                 "per_repeat": times})
    table = Table(title="recording overhead (median of per-run median step times)")
    for col in ("model", "mode", "plain (s)", "profiled (s)", "overhead"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["model"], r["mode"], f"{r['plain_s']:.4f}", f"{r['profiled_s']:.4f}",
                      f"{r['overhead_pct']:+.1f}%")
    console.print(table)
    return rows


COMPARED = ("ddp", "bsrun-fixed")  # what-if replays one fixed point: adaptation stays off


def validate(models, bandwidths, steps, warmup, repeat, batch, record_steps, console, keep=None) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bsrun-calibrate-") as scratch:
        cwd = Path(scratch)
        for model in models:
            for bandwidth in bandwidths:
                measured = {r["mode"]: r["median_step_s"] for r in
                            run_bench([model], 2, [bandwidth], list(COMPARED), steps, warmup, repeat, batch,
                                      None, console)}
                for source in COMPARED:
                    folder = Path(keep or cwd) / f"prof-{model}-{bandwidth}-{source}"
                    out = cwd / "unused.json"
                    args = profile_args(folder, model, source, bandwidth, 10000, warmup, batch, out, record_steps)
                    run_once(args, source, cwd, out, run_timeout_s(record_steps, warmup))
                    try:
                        model_fit = whatif.fit(trace.load(folder))
                    except Exception as e:  # a failed profile is reported, the others go on
                        console.print(f"{model} {bandwidth} profile of {source} failed: {e}", markup=False)
                        continue
                    p = model_fit.profiled
                    for target in COMPARED:
                        predicted = whatif.predict(model_fit, p["partition"] or 4 * 2 ** 20,
                                                   p["credit"] or 8 * 2 ** 20, target != "ddp")
                        m = measured.get(target)
                        rows.append({"model": model, "bandwidth": bandwidth, "profiled": source, "predicted_mode": target,
                                     "profile": str(folder),
                                     "predicted_s": predicted, "measured_s": m,
                                     "profiled_step_s": p["measured_step_s"],
                                     "error_pct": None if not m else 100 * (predicted / m - 1),
                                     "alpha_ms": model_fit.alpha * 1e3, "gbit_per_s": 8e-9 / model_fit.beta})
                        console.print(f"{model} {bandwidth}: from the {source} profile, {target} predicted "
                                      f"{predicted:.3f} s, measured {m:.3f} s", highlight=False)
    table = Table(title="what-if prediction vs measured step time (bsrun bench medians)")
    for col in ("model", "bandwidth", "profiled", "predicted mode", "predicted (s)", "measured (s)", "error"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["model"], r["bandwidth"] or "loopback", r["profiled"], r["predicted_mode"],
                      f"{r['predicted_s']:.3f}", "-" if r["measured_s"] is None else f"{r['measured_s']:.3f}",
                      "-" if r["error_pct"] is None else f"{r['error_pct']:+.1f}%")
    console.print(table)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bsrun.bench.calibrate", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("overhead", "whatif"):
        s = sub.add_parser(name)
        s.add_argument("--model", default="resnet50" if name == "overhead" else "vgg16,resnet50")
        s.add_argument("--bandwidth", default="none" if name == "overhead" else "1gbit,3gbit")
        s.add_argument("--steps", type=int, default=10)
        s.add_argument("--warmup", type=int, default=3)
        s.add_argument("--repeat", type=int, default=3 if name == "overhead" else 2)
        s.add_argument("--batch", type=int, default=None)
        s.add_argument("--json", dest="json_path", default=None)
    sub.choices["overhead"].add_argument("--modes", default="ddp,bsrun")
    sub.choices["whatif"].add_argument("--record-steps", type=int, default=6)
    sub.choices["whatif"].add_argument("--keep", default=None, help="keep the profiles in this folder")
    a = p.parse_args(argv)
    console = new_console()
    models = a.model.split(",")
    bandwidths = [None if b == "none" else b for b in a.bandwidth.split(",")]
    if a.what == "overhead":
        rows = [r for b in bandwidths
                for r in overhead(models, b, a.modes.split(","), a.steps, a.warmup, a.repeat, a.batch, console)]
    else:
        rows = validate(models, bandwidths, a.steps, a.warmup, a.repeat, a.batch, a.record_steps, console, a.keep)
    if a.json_path:
        atomic_write_json(Path(a.json_path), {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
