"""Judge `bsrun tune` against a grid over the same space, on a reference model (BENCHMARKS.md).

    python scripts/tune_vs_grid.py --model vgg16 --batch 96 --bandwidth 1gbit -np 2 \\
        --trials 9 --recheck 3 --repeat 3 --out tune-vs-grid.json

In one scratch folder, one after the other, all with the same trial machinery (each
trial a real `bsrun` launch of `python -m bsrun.bench.worker --mode bsrun`):

1. tune:    `bsrun tune --fresh --trials T --recheck R ...`: the tuner's committed config
            (T + R launches);
2. grid:    `bsrun tune --grid ...`: every point of the log-spaced grid over the same
            space (partition x4 from 64 KiB to 128 MiB, credit x2 from 1x to 16x);
3. compare: the defaults, the committed config and the grid's best, launched again in
            turn (D C G D C G ...) `--repeat` times, so that drift hits all alike and the
            grid's best is not judged by the one lucky measurement that made it best.

Figures: per config the median of its repeat medians and their min-max; the committed
config's step time over the grid best's and over the defaults' (a config that is two of
these, e.g. the defaults committed, is measured once a round under both names). Every trial is in the
job's journal (`bsrun tune show` in the scratch folder, kept with --keep).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bsrun.cli import job_of
from bsrun.fsutil import atomic_write_json
from bsrun.launch.plan import NetworkSpec
from bsrun.launch.netem import parse_rate
from bsrun.tune.journal import TUNE_DIR, Journal, journal_path, read_records
from bsrun.tune.space import parse_space
from bsrun.tune.trial import TrialSetup, run_trial


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="vgg16")
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--bandwidth", default="1gbit", help="emulated link rate, or 'none'")
    p.add_argument("-np", "--nproc", type=int, default=2)
    p.add_argument("--trials", type=int, default=9)
    p.add_argument("--recheck", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3, help="rounds of the final comparison")
    p.add_argument("--skip-grid", action="store_true", help="compare the tuner with the defaults only")
    p.add_argument("--keep", default=None, help="keep the scratch folder (journal, logs) here")
    p.add_argument("--out", default="tune-vs-grid.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    launch = ["-np", str(a.nproc), "--grace", "5"]
    network = None
    if a.bandwidth != "none":
        launch = ["--emulate-bandwidth", a.bandwidth, *launch]
        network = NetworkSpec(parse_rate(a.bandwidth))
    command = ["python", "-m", "bsrun.bench.worker", "--model", a.model, "--batch", str(a.batch), "--mode", "bsrun",
               "--steps", "100000", "--warmup", "0", "--out", "unused.json"]
    timing = ["--steps", str(a.steps), "--warmup", str(a.warmup)]
    scratch = Path(tempfile.mkdtemp(prefix="bsrun-tune-vs-grid-"))
    bsrun = [sys.executable, "-m", "bsrun", "tune"]
    try:
        subprocess.run([*bsrun, "--fresh", "--trials", str(a.trials), "--recheck", str(a.recheck), *timing,
                        *launch, *command], cwd=scratch, check=True)
        if not a.skip_grid:
            subprocess.run([*bsrun, "--grid", *timing, *launch, *command], cwd=scratch, check=True)
        signature, _ = job_of(command, a.nproc, network)
        result = compare(a, scratch, signature, launch, command)
        atomic_write_json(Path(a.out), result)
        print(json.dumps(result["summary"], indent=2))
    finally:
        if a.keep:
            shutil.copytree(scratch, a.keep, dirs_exist_ok=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def compare(a, scratch: Path, signature: str, launch: list[str], command: list[str]) -> dict:
    """Phase 3: defaults, committed and grid best, interleaved `repeat` times."""
    os.chdir(scratch)  # trials read and write .bsrun/ of the folder they run in
    records = read_records(journal_path(signature))
    tuned = json.loads((scratch / ".bsrun" / "tuned.json").read_text())["jobs"][signature]
    grid = [r for r in records if r.get("kind") == "grid" and r["status"] == "ok"]
    configs: dict[str, dict] = {}  # label -> config; one config is measured once a round
    named = [("defaults", parse_space(None, {}).defaults()), ("committed", tuned["config"])]
    if grid:
        named.append(("grid best", min(grid, key=lambda r: r["step_s"])["config"]))
    for name, config in named:
        same = next((label for label, c in configs.items() if c == config), None)
        if same is None:
            configs[name] = config
        else:
            configs[f"{same} = {name}"] = configs.pop(same)
    journal = Journal(journal_path(signature), records)
    setup = TrialSetup(launch, command, a.warmup, a.steps, 600.0, 5.0, TUNE_DIR / signature)
    measured: dict[str, list[float]] = {name: [] for name in configs}
    for rep in range(a.repeat):
        for name, config in configs.items():
            n = journal.next_number()
            outcome = run_trial(setup, n, config)
            journal.append({"type": "trial", "n": n, "kind": "compare", "label": name, "config": config,
                            "warmup": a.warmup, "steps": a.steps, **outcome.record()})
            step = journal.records[-1].get("step_s")
            print(f"compare {rep + 1}/{a.repeat} {name} {config}: "
                  f"{'%.4f s' % step if step else outcome.status + ': ' + str(outcome.reason)}", flush=True)
            if step:
                measured[name].append(step)
    summary = {name: {"config": configs[name], "median_step_s": statistics.median(v) if v else None,
                      "spread": [min(v), max(v)] if v else None, "repeats": len(v)}
               for name, v in measured.items()}
    def step_of(name):
        label = next((label for label in summary if name in label.split(" = ")), None)
        return label, summary[label]["median_step_s"] if label else None

    committed_label, c = step_of("committed")
    for name in ("defaults", "grid best"):
        label, other = step_of(name)
        if label is not None and c and other:
            summary[f"committed / {name}"] = 1.0 if label == committed_label else c / other
    summary["tuner launches"] = len([r for r in records if r.get("kind") in ("search", "recheck")])
    summary["grid points"] = len(grid)
    summary["grid best single measurement"] = min((r["step_s"] for r in grid), default=None)
    return {"summary": summary, "journal": journal.records, "tuned": tuned}


if __name__ == "__main__":
    sys.exit(main())
