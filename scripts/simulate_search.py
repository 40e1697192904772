"""What adaptation's search keeps under noise: its Explorer, fed simulated step times.

    python scripts/simulate_search.py                      # this tree's search
    python scripts/simulate_search.py --commit b6d3b2f     # another commit's, beside it

The bench cannot say how often the search keeps the wrong point: each run is one draw,
and a run costs a minute. Here the search (bsrun/sched/adaptive.py, pure) runs many times
on windows drawn like this machine's: the starting point `gain` faster than plain DDP
(negative: slower), each step's time spread by --noise (a normal draw), the run drifting
by up to --drift a window (a random walk), DDP's reducer the point to beat
(fallback_first); with --rival, a second point that gain faster than plain DDP (the
fastest sweep window is not always the best point). Prints per gain the share of runs
that kept the starting point (and the rival) and the windows a search took. Seeded: the
same arguments print the same table.
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


def kept_share(adaptive, gain: float, noise: float, drift: float, runs: int, seed: int,
               rival: float | None = None) -> tuple[float, float, float]:
    """(share of runs that kept the starting point, share that kept the rival, mean windows
    a search took); `rival`: a second point's gain against plain DDP (as the configured
    point, timed in the sweep after the start), or None for none."""
    rng = random.Random(seed)
    start = adaptive.Point(4 * 2**20, 8 * 2**20, "forward", True)
    other = adaptive.Point(64 * 2**20, 128 * 2**20, "forward", True)
    gains = {start: gain, other: rival or 0.0}
    kept = kept_rival = windows = 0
    for _ in range(runs):
        level = 1.0
        explorer = adaptive.Explorer(start, adaptive.Fixed(), others=[other] if rival is not None else [],
                                     fallback_first=True)
        explorer.start()
        while explorer.searching:
            level *= 1 + rng.uniform(-drift, drift)
            base = level * (1 - gains.get(explorer.current, 0.0))
            explorer.window_done([base * rng.gauss(1, noise) for _ in range(adaptive.WINDOW - 1)], [])
            windows += 1
        kept += explorer.kept == start
        kept_rival += explorer.kept == other
    return kept / runs, kept_rival / runs, windows / runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--commit", help="also simulate this commit's search, beside this tree's")
    p.add_argument("--noise", type=float, default=0.10, help="one step's relative spread (default 0.10)")
    p.add_argument("--drift", type=float, default=0.05, help="the most a window moves from the last (0.05)")
    p.add_argument("--runs", type=int, default=400)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--rival", type=float, help="a second point's gain against plain DDP (default: none)")
    a = p.parse_args()
    trees = {"this tree": load(HERE / "bsrun/sched/adaptive.py", "adaptive_here")}
    if a.commit:
        source = subprocess.run(["git", "show", f"{a.commit}:bsrun/sched/adaptive.py"], cwd=HERE,
                                capture_output=True, text=True, check=True).stdout
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "adaptive.py"
            path.write_text(source)
            trees[a.commit] = load(path, "adaptive_there")
    what = "starting point kept" if a.rival is None else f"starting point / rival ({a.rival:+.2f}) kept"
    print(f"{what} (share of {a.runs} runs; windows a search took), step noise {a.noise:.0%}, "
          f"drift up to {a.drift:.0%} a window; gain: the starting point against plain DDP")
    print("gain    " + "  ".join(f"{name:>24}" for name in trees))
    for gain in GAINS:
        cells = [kept_share(m, gain, a.noise, a.drift, a.runs, a.seed, a.rival) for m in trees.values()]
        print(f"{gain:+.2f}   " + "  ".join(
            (f"{share:>16.3f}" if a.rival is None else f"{share:>9.3f} / {other:.3f}") + f" ({w:4.1f} w)"
            for share, other, w in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
