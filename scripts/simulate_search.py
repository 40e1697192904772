"""What adaptation's search keeps under noise: its Explorer, fed simulated step times.

    python scripts/simulate_search.py                      # this tree's search
    python scripts/simulate_search.py --commit b6d3b2f     # another commit's, beside it

The bench cannot say how often the search keeps the wrong point: each run is one draw,
and a run costs a minute. Here the search (bsrun/sched/adaptive.py, pure) runs many times
on windows drawn like this machine's: the starting point `gain` faster than plain DDP
(negative: slower), each step's time spread by --noise (a normal draw), the run drifting
by up to --drift a window (a random walk), DDP's reducer the point to beat
(fallback_first). Prints per gain the share of runs that kept the starting point and the
windows a search took. Seeded: the same arguments print the same table.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
GAINS = (-0.1, -0.05, -0.02, 0.0, 0.05, 0.1, 0.15, 0.2)


def load(path: Path, name: str):
    """bsrun/sched/adaptive.py of some tree, as a module of its own."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def kept_share(adaptive, gain: float, noise: float, drift: float, runs: int, seed: int) -> tuple[float, float]:
    """(share of runs that kept the starting point, mean windows a search took)."""
    rng = random.Random(seed)
    start = adaptive.Point(4 * 2**20, 8 * 2**20, "forward", True)
    kept = windows = 0
    for _ in range(runs):
        level = 1.0
        explorer = adaptive.Explorer(start, adaptive.Fixed(), fallback_first=True)
        explorer.start()
        while explorer.searching:
            level *= 1 + rng.uniform(-drift, drift)
            base = level * (1 - gain if explorer.current == start else 1.0)
            explorer.window_done([base * rng.gauss(1, noise) for _ in range(adaptive.WINDOW - 1)], [])
            windows += 1
        kept += explorer.kept == start
    return kept / runs, windows / runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--commit", help="also simulate this commit's search, beside this tree's")
    p.add_argument("--noise", type=float, default=0.10, help="one step's relative spread (default 0.10)")
    p.add_argument("--drift", type=float, default=0.05, help="the most a window moves from the last (0.05)")
    p.add_argument("--runs", type=int, default=400)
    p.add_argument("--seed", type=int, default=17)
    a = p.parse_args()
    trees = {"this tree": load(HERE / "bsrun/sched/adaptive.py", "adaptive_here")}
    if a.commit:
        source = subprocess.run(["git", "show", f"{a.commit}:bsrun/sched/adaptive.py"], cwd=HERE,
                                capture_output=True, text=True, check=True).stdout
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "adaptive.py"
            path.write_text(source)
            trees[a.commit] = load(path, "adaptive_there")
    print(f"starting point kept (share of {a.runs} runs; windows a search took), step noise {a.noise:.0%}, "
          f"drift up to {a.drift:.0%} a window; gain: the starting point against plain DDP")
    print("gain    " + "  ".join(f"{name:>18}" for name in trees))
    for gain in GAINS:
        cells = [kept_share(m, gain, a.noise, a.drift, a.runs, a.seed) for m in trees.values()]
        print(f"{gain:+.2f}   " + "  ".join(f"{share:>10.3f} ({w:4.1f} w)" for share, w in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
