"""Side by side: `bsrun bench` of this tree and of another commit, alternating, on one machine.

    python scripts/bench_against_commit.py --commit c3f0e47~1 --model vgg16,resnet50 \
        --bandwidth 1gbit --repeat 3

What a change costs the scheduled run (e.g. the exactness guards of issue 15): the other
commit is checked out into a temporary git worktree; for each repeat and model, one
`python -m bsrun bench --modes ddp,MODE --repeat 1` runs from each tree in turn (this
tree first on even repeats, the other first on odd ones), so drift on the machine hits
both alike. Each bench run also measures plain DDP, the same code in both trees: its
ratio between the trees says how much of a difference is the machine. Prints per model
the median of the per-run medians of each mode and tree, their min-max, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def bench_once(tree: Path, model: str, bandwidth: str, steps: int, warmup: int, out: Path,
               mode: str) -> dict[str, float]:
    """One `bsrun bench` run from `tree`: {"ddp": median step (s), "bsrun": mode's}."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "bsrun", "bench", "--model", model, "--bandwidth", bandwidth,
           "--modes", f"ddp,{mode}", "--repeat", "1", "--steps", str(steps), "--warmup", str(warmup),
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"bench from {tree} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return {"bsrun" if r["mode"] == mode else r["mode"]: r["median_step_s"]
            for r in json.loads(out.read_text())["results"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--commit", required=True, help="the other commit (e.g. the one before a change)")
    p.add_argument("--model", default="vgg16,resnet50")
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None, help="also write every run's medians here")
    p.add_argument("--mode", default="bsrun", help="the scheduled bench mode both trees run (bsrun-fixed: "
                                                    "no adaptation, where both trees have it)")
    args = p.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bsrun-against-"))
    other = scratch / "other"
    subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", str(other), args.commit],
                   check=True, capture_output=True)
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for rep in range(args.repeat):
            for model in args.model.split(","):
                trees = [("this", HERE), ("other", other)]
                for name, tree in trees if rep % 2 == 0 else trees[::-1]:
                    medians = bench_once(tree, model, args.bandwidth, args.steps, args.warmup,
                                         scratch / f"{model}-{name}-{rep}.json", args.mode)
                    runs.setdefault((model, name), []).append(medians)
                    print(f"{model} {args.bandwidth} {name} ({rep + 1}/{args.repeat}): "
                          + ", ".join(f"{m} {t:.4f} s" for m, t in medians.items()), flush=True)
    finally:
        subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(other)], capture_output=True)
    summary = []
    for model in args.model.split(","):
        row = {"model": model, "bandwidth": args.bandwidth, "commit": args.commit}
        for name in ("this", "other"):
            for mode in ("ddp", "bsrun"):
                values = [r[mode] for r in runs[(model, name)]]
                row[f"{mode}_{name}"] = statistics.median(values)
                row[f"{mode}_{name}_spread"] = [min(values), max(values)]
        row["bsrun_this_over_other"] = row["bsrun_this"] / row["bsrun_other"]
        row["ddp_this_over_other"] = row["ddp_this"] / row["ddp_other"]
        summary.append(row)
        print(f"{model} {args.bandwidth}: bsrun this {row['bsrun_this']:.4f} s "
              f"({row['bsrun_this_spread'][0]:.4f}-{row['bsrun_this_spread'][1]:.4f}), other {row['bsrun_other']:.4f} s "
              f"({row['bsrun_other_spread'][0]:.4f}-{row['bsrun_other_spread'][1]:.4f}): this/other "
              f"{row['bsrun_this_over_other']:.3f}; ddp this/other {row['ddp_this_over_other']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": {f"{m}-{n}": r for (m, n), r in runs.items()}},
                                              indent=2))


if __name__ == "__main__":
    main()
