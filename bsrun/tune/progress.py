"""What `bsrun tune` shows: a live table of the trials on a terminal, a line per trial
otherwise, and the same table for `bsrun tune show`."""

from __future__ import annotations

import time

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from bsrun.config import TUNABLE


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def say(console, line: str) -> None:
    """One plain line: no rich markup, whatever a command or an error message contains."""
    console.print(line, highlight=False, markup=False)


def describe_config(config: dict[str, str]) -> str:
    """`partition=4MiB, credit=2x`, knobs in TUNABLE order (journal records sort their keys)."""
    order = {k: i for i, k in enumerate(TUNABLE)}
    return ", ".join(f"{k}={config[k]}" for k in sorted(config, key=lambda k: order.get(k, len(order))))


def trials_table(records: list[dict], title: str | None = None) -> Table:
    """One row per trial of a journal, with the best median step so far."""
    header = records[0] if records and records[0].get("type") == "job" else {}
    fixed = header.get("space", {}).get("fixed", {})
    caption = "step: median of the timed steps; spread: their interquartile range"
    if fixed:
        caption += f"; fixed by the user: {describe_config(fixed)}"
    table = Table(title=Text(title) if title else None, caption=caption)
    knobs = [k for k in TUNABLE if k not in fixed]
    for col in ("#", "kind", *knobs, "step (s)", "steps/s", "spread (s)", "best (s)", "status", "time (s)"):
        table.add_column(col, justify="left" if col in ("kind", "status", *knobs) else "right")
    best = None
    committed = next((r["config"] for r in reversed(records) if r.get("type") == "commit"), None)
    for r in records:
        if r.get("type") != "trial":
            continue
        if r["status"] == "ok":
            best = r["step_s"] if best is None else min(best, r["step_s"])
        spread = "-" if not r.get("spread") else f"{r['spread'][0]:.4g}-{r['spread'][1]:.4g}"
        status = "ok" if r["status"] == "ok" else f"{r['status']}: {r.get('reason')}"
        if committed is not None and r["config"] == committed and r["status"] == "ok":
            status += " (committed)"
        table.add_row(str(r["n"]), r["kind"], *(r["config"].get(k, "-") for k in knobs),
                      _fmt(r.get("step_s"), ".4g"), _fmt(r.get("score"), ".3g"), spread,
                      _fmt(best, ".4g"), Text(status), _fmt(r.get("duration_s"), ".0f"))
    return table


class Progress:
    """The trials so far, the one running and the time left; live on a terminal."""

    def __init__(self, console, journal, planned: int):
        self.console, self.journal, self.planned = console, journal, planned
        self.done_here = 0
        self.current: tuple[int, str, dict, float] | None = None
        self.live = Live(self, console=console, refresh_per_second=2) if console.is_terminal else None

    def __enter__(self):
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)

    def _mean_duration(self) -> float | None:
        durations = [r["duration_s"] for r in self.journal.trials() if r.get("duration_s")]
        return sum(durations) / len(durations) if durations else None

    def _status(self) -> str:
        if self.current is None:
            return ""
        number, kind, config, started = self.current
        running = time.time() - started
        line = f"trial {number} ({kind}, {self.done_here + 1} of {self.planned} in this run): {describe_config(config)}"
        if self.live is not None:
            line += f", running {running:.0f} s"
        mean = self._mean_duration()
        if mean is not None:
            left = max(0.0, mean * (self.planned - self.done_here) - running)
            line += f"; about {left / 60:.1f} min left" if left >= 60 else f"; about {left:.0f} s left"
        return line

    def __rich__(self):
        return Group(trials_table(self.journal.records), Text(self._status()))

    def start(self, number: int, kind: str, config: dict) -> None:
        self.current = (number, kind, config, time.time())
        if self.live is None:
            say(self.console, f"bsrun: {self._status()}")

    def finish(self, record: dict) -> None:
        self.current = None
        self.done_here += 1
        if self.live is not None:
            self.live.refresh()
            return
        result = (f"{record['step_s']:.4g} s/step ({record['score']:.3g} steps/s)" if record["status"] == "ok"
                  else f"{record['status']}: {record['reason']}")
        say(self.console, f"bsrun: trial {record['n']} ({record['kind']}) {describe_config(record['config'])}: "
                          f"{result}")
