"""A profile's summary as rich tables: per layer, per iteration, and the what-if model."""

from __future__ import annotations

from rich.table import Table

from bsrun.launch.summary import _human_bytes as _bytes
from bsrun.profile.analysis import LAYER_KEYS


def _ms(x: float) -> str:
    return f"{x:.2f}"


def layer_table(summary: dict) -> Table:
    table = Table(title="per layer (ms per iteration, mean over ranks)",
                  caption="comm, queue, exposed: the layer's share (by bytes) of the partitions or buckets "
                          "holding its gradients")
    for col in ("layer", "type", "params", "bytes", "forward", "backward", "comm", "queue", "exposed comm"):
        table.add_column(col, justify="left" if col in ("layer", "type") else "right")
    for row in summary["layers"]:
        table.add_row(row["name"], row["type"], f"{row['params']:,}", _bytes(row["bytes"]),
                      *(_ms(row[k]) for k in LAYER_KEYS))
    t = summary["layer_totals"]
    if summary["layers"]:
        table.add_row("total", "", f"{t['params']:,}", _bytes(t["bytes"]), *(_ms(t[k]) for k in LAYER_KEYS),
                      style="bold")
    return table


def iteration_table(summary: dict) -> Table:
    table = Table(title="per iteration (ms, mean over ranks)",
                  caption="compute: passes + updates less waits; overlap: comm during compute / comm; "
                          "bound: max(compute, comm); efficiency: bound / step")
    for col in ("step", "step ms", "compute", "comm", "overlap", "exposed comm", "idle", "bound", "efficiency"):
        table.add_column(col, justify="right")

    def cells(r):
        return (_ms(r["step_ms"]), _ms(r["compute_ms"]), _ms(r["comm_ms"]), f"{r['overlap_pct']:.0f}%",
                _ms(r["exposed_comm_ms"]), _ms(r["idle_ms"]), _ms(r["bound_ms"]), f"{r['efficiency']:.2f}")

    for row in summary["iterations"]:
        table.add_row(str(row["step"]), *cells(row))
    if summary["iterations"]:
        table.add_row("median", *cells(summary["median"]), style="bold")
    return table


def straggler_lines(summary: dict) -> list[str]:
    """What no schedule can take off the step: the slowest rank's compute, which every
    synchronous step waits for (ranks of one job differ a lot on a busy machine), and
    how far apart the ranks' backward passes end."""
    median = summary.get("median") or {}
    if len(summary.get("ranks") or []) < 2 or not median:
        return []
    step, slowest, mean = median["step_ms"], median["slowest_compute_ms"], median["compute_ms"]
    left = max(0.0, step - slowest)
    return [f"slowest rank's compute: {slowest:.1f} ms a step (mean over ranks {mean:.1f} ms); a synchronous "
            f"step cannot be shorter, so {left:.1f} ms ({100 * left / step:.0f}%) of the {step:.1f} ms step "
            f"is left to scheduling (medians)",
            f"rank lag: the ranks' backward passes end {median['rank_lag_ms']:.1f} ms apart (median); the "
            f"earlier rank's last gradients wait that long for the other's"]


def model_lines(summary: dict) -> list[str]:
    model = summary.get("whatif")
    if not model:
        return []
    lines = [f"link model: {model['alpha_ms']:.3f} ms + {model['gbit_per_s']:.3g} Gbit/s per collective "
             f"(alpha-beta, least squares over {model['transfers']} transfers); decision latency "
             f"{model['decision_ms']:.2f} ms; update {model['update_ms_per_mb']:.3f} ms/MB"]
    own = model.get("self_check")
    if own and own.get("measured_ms"):
        lines.append(f"what-if replay of this config: {own['predicted_ms']:.1f} ms vs {own['measured_ms']:.1f} ms "
                     f"measured ({own['error_pct']:+.1f}%)")
    if model.get("perfect_schedule_ms") is not None:
        lines.append(f"a perfect schedule of this job (same compute, link and dependencies; nothing per "
                     f"collective or decision): {model['perfect_schedule_ms']:.1f} ms a step")
    return lines


def whatif_table(rows: list[dict]) -> Table:
    table = Table(title="what-if (replay of the profile)")
    for col in ("config", "predicted step (ms)", "collectives", "speedup vs profiled"):
        table.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        table.add_row(r["config"], f"{r['predicted_ms']:.1f}", str(r["collectives"]),
                      "-" if r.get("vs_profiled") is None else f"{r['vs_profiled']:.2f}x")
    return table
