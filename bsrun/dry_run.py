"""What `bsrun --dry-run` prints: the resolved config and each process's command and environment."""

from __future__ import annotations

import json
import shlex

from rich.table import Table

from bsrun.console import new_console

# The variables shown: every BSRUN_* one and these, where the launch changes them.
SHOWN_PREFIX = "BSRUN_"
SHOWN = ("PYTHONPATH", "OMP_NUM_THREADS", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
         "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")


def _visible(plan, env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(env.items())
            if (k.startswith(SHOWN_PREFIX) or k in SHOWN) and plan.base_env.get(k) != v}


def print_dry_run(plan, as_json: bool) -> None:
    """The plan as a table and command lines, or (as_json) as one JSON object on stdout."""
    specs = plan.worker_specs()
    if as_json:
        print(json.dumps({"config": plan.config.as_dict(), "kind": plan.kind,
                          "workers": [{"rank": s.rank, "argv": s.argv, "env": _visible(plan, s.env)}
                                      for s in specs]}, indent=2))
        return
    console = new_console()
    table = Table(title="resolved config")
    for col in ("knob", "value", "source"):
        table.add_column(col)
    for name, source in plan.config.sources.items():
        value = plan.config.as_dict()[name]
        if name == "credit":
            value = f"{value} ({plan.config.credit_bytes} bytes)"
        table.add_row(name, str(value), source)
    console.print(table)
    for spec in specs:
        who = spec.name if plan.kind == "local" else "command (run as given; its workers are found where they build DDP)"
        console.print(f"[bold]{who}[/bold]: {shlex.join(spec.argv)}", highlight=False)
        for k, v in _visible(plan, spec.env).items():
            console.print(f"    {k}={v}", highlight=False, markup=False, soft_wrap=True)
