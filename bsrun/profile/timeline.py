"""timeline.png: a Gantt chart of one steady-state iteration, two tracks per rank.

The iteration shown is the recorded one whose step time (rank 0) is the median. Each
rank has a compute track (forward spans of layers, backward spans, waits for
communication, updates) and a communication track (transfers, with their queued time
as a thin bar), on rank 0's aligned clock, in ms from the iteration's start.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bsrun.profile.analysis import RankView

COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "wait": "#C44E52", "update": "#55A868",
           "transfer": "#8172B3", "queue": "#CCB9DA"}


def pick_iteration(views: list[RankView]) -> tuple[float, float, int] | None:
    windows = views[0].windows() if views else []
    if not windows:
        return None
    steady = windows[1:] or windows
    median = statistics.median_low([b - a for a, b, _ in steady])
    return next(w for w in steady if w[1] - w[0] == median)


def draw(views: list[RankView], path: Path, title: str = "") -> tuple[float, float, int] | None:
    """Write the chart of the median iteration to `path`; returns that iteration's window."""
    window = pick_iteration(views)
    if window is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lo, hi, step = window
    span = hi - lo
    margin = 0.02 * span

    def bars(spans):
        return [((s.t0 - lo) / 1e3, (s.t1 - s.t0) / 1e3) for s in spans if s.t1 > lo - margin and s.t0 < hi + margin]

    tracks = []
    for v in views:
        compute = [("forward", bars([s for spans in v.forward.values() for s in spans
                                     if spans and s.name in v.layer_of.values()]), 0.8),
                   ("backward", bars([s for spans in v.backward.values() for s in spans]), 0.8),
                   ("wait", bars(v.waits), 0.8), ("update", bars(v.updates), 0.4)]
        queued = [type(s)(s.name, s.args.get("ready_us", s.t0), s.args.get("post_us", s.t0)) for s in v.transfers]
        comm = [("queue", bars(queued), 0.25), ("transfer", bars(v.transfers), 0.8)]
        tracks += [(f"rank {v.rank} compute", compute), (f"rank {v.rank} comm", comm)]
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.7 * len(tracks)))
    for y, (_, layers) in enumerate(reversed(tracks)):
        for kind, segments, height in layers:
            if segments:
                ax.broken_barh(segments, (y - height / 2, height), facecolors=COLOURS[kind],
                               edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(tracks)), [name for name, _ in reversed(tracks)])
    ax.set_xlim(-margin / 1e3, (span + margin) / 1e3)
    ax.set_xlabel(f"ms from the start of iteration {step} (step {step - 1} returned on rank 0)")
    ax.set_title(title or f"iteration {step}: {span / 1e3:.1f} ms")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if len(tracks) <= 4 else -0.2), ncol=len(COLOURS), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return window
