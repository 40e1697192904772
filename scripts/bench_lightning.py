"""Side by side: a PyTorch Lightning script plain and under bsrun, alternating, on one machine.

    python scripts/bench_lightning.py --bandwidth 1gbit --repeat 3 --steps 12 --batch 64

Runs examples/train_lightning.py (VGG-11-style, automatic optimisation, DDP strategy) as
`bsrun [--no-schedule] --emulate-bandwidth BW -np 2 python examples/train_lightning.py`:
both ranks on emulated hosts joined by a BW link (needs root), plain Lightning
(`--no-schedule` leaves DDP as it is) and scheduled in turn, the order flipped on every
repeat so that drift on the machine hits both alike. Prints each mode's median of the
per-run median step times, the min-max of those medians, and the ratio plain/bsrun
(above 1: bsrun is faster), and checks from the run summary that bsrun really scheduled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
SCRIPT = HERE / "examples" / "train_lightning.py"
MODES = {"plain": ["--no-schedule"], "bsrun": []}


def run_once(mode: str, args, out: Path) -> float:
    """One launch; rank 0's median step time (s)."""
    cmd = [sys.executable, "-m", "bsrun", *MODES[mode], "-np", "2"]
    if args.bandwidth != "none":
        cmd += ["--emulate-bandwidth", args.bandwidth]
    cmd += ["python", str(SCRIPT), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--batch", str(args.batch), "--times", str(out)]
    proc = subprocess.run(cmd, cwd=out.parent, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    ranks = json.loads((out.parent / ".bsrun" / "last-run.json").read_text())["ranks"]
    modes = {r.get("mode") for r in ranks}
    expected = "off" if mode == "plain" else "scheduled"
    if modes != {expected} or (mode == "bsrun" and not all(r["partitions"] > 0 for r in ranks)):
        raise SystemExit(f"{mode}: the ranks ran as {sorted(modes)}, not {expected}:\n{proc.stderr[-3000:]}")
    return statistics.median(json.loads(out.read_text()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bandwidth", default="1gbit", help="emulated link rate, or none for loopback")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bsrun-lightning-"))
    medians: dict[str, list[float]] = {mode: [] for mode in MODES}
    for rep in range(args.repeat):
        order = list(MODES) if rep % 2 == 0 else list(MODES)[::-1]
        for mode in order:
            medians[mode].append(run_once(mode, args, scratch / f"{mode}-{rep}.json"))
            print(f"repeat {rep + 1} {mode}: {medians[mode][-1]:.3f} s/step", flush=True)
    for mode, values in medians.items():
        print(f"{mode:6s} median {statistics.median(values):.3f} s/step "
              f"(min {min(values):.3f}, max {max(values):.3f}, {len(values)} runs)")
    ratio = statistics.median(medians["plain"]) / statistics.median(medians["bsrun"])
    print(f"plain/bsrun: {ratio:.3f} (above 1: bsrun faster)")


if __name__ == "__main__":
    main()
