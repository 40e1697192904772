"""One bench launch: its arguments, its run and its result, as `bsrun ... -np N python -m
bsrun.bench.worker ...` in a child process (bsrun.child: it ends with the benchmark), so a
measurement runs exactly what a user runs. The worker's modes and bsrun's flags for each
bench mode live here; bsrun/bench/runner.py alternates and summarises the launches,
bsrun/bench/replay.py profiles and replays one. Torch-free, like both.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bsrun import child
from bsrun.errors import BsrunError
from bsrun.launch.summary import decider_adaptation, rank_modes, read_last_run
from bsrun.sched.adaptive import SEARCH_STEPS, describe_point

MODES = ("ddp", "bsrun", "horovod", "bsrun-horovod", "compute", "comm", "bound", "overlap")  # the worker's
ORDERS = ("forward", "tic", "tac", "fifo")
SCHEDULED_MODES = ("bsrun", "bsrun-fixed", "bsrun-horovod", "bsrun-horovod-fixed", "ps",
                   *(f"bsrun:{o}" for o in ORDERS))  # others: --no-schedule
ADAPTING_MODES = ("bsrun", "bsrun-horovod")  # bsrun's defaults, adaptation included; other scheduled modes: --no-adapt
FIXED_MODES = {"bsrun-fixed": "bsrun", "bsrun-horovod-fixed": "bsrun-horovod"}  # --no-adapt, and the worker mode
PS_BASELINE = ["--order", "fifo", "--partition", "tensor"]  # and the default credit: unlimited then
TAIL_LINES = 20
STOP_GRACE_S = 30.0  # bsrun itself gives its workers 10 s, then tears the network down


def run_timeout_s(steps: int, warmup: int) -> float:
    """Generous: start-up plus 20 s a step; only a hung run should ever reach it."""
    return 120.0 + 20.0 * (steps + warmup)


@functools.cache
def available_models() -> tuple[str, ...]:
    """The worker's model names, asked from a child so this process stays torch-free."""
    proc = subprocess.run([sys.executable, "-m", "bsrun.bench.worker", "--list-models"],
                          capture_output=True, text=True, env=child.env(), timeout=120)
    if proc.returncode != 0:
        raise BsrunError(f"could not list the benchmark models: {_tail(proc.stdout + proc.stderr, 1)}")
    return tuple(proc.stdout.split())


@dataclass
class RunResult:
    """One launch: its step times (rank 0) or why it failed."""

    mode: str
    step_times: list[float] = field(default_factory=list)
    info: dict = field(default_factory=dict)  # the worker's JSON
    launched_as: str | None = None  # what the launcher's summary says the ranks ran as
    error: str | None = None
    kept: str | None = None  # the point rank 0's adaptation kept (mode bsrun)
    late_decisions: list[str] = field(default_factory=list)  # adaptation's, inside the timed steps
    first_keep: int | None = None  # the step at which adaptation's first search kept a point


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    kept = text.strip().splitlines()[-lines:]
    return "\n".join(kept) if kept else "(no output)"


def arch_flags(mode: str, arch: str, servers: int, profile: Path | None = None) -> list[str]:
    """bsrun's flags for a mode: its scheduling, adaptation, order and, with --arch ps, the servers."""
    if mode not in SCHEDULED_MODES:
        return ["--no-schedule"]
    flags = ["--schedule"] if mode in ADAPTING_MODES else ["--schedule", "--no-adapt"]
    if mode == "ps" or (arch == "ps" and not mode.startswith("bsrun-horovod")):  # Horovod stays on its all-reduce
        flags += ["--arch", "ps", "--servers", str(servers)]
    if mode == "ps":
        flags += PS_BASELINE
    elif mode.startswith("bsrun:"):
        order = mode.partition(":")[2]
        flags += ["--order", f"tac:{profile}" if order == "tac" else order]
    return flags


def worker_mode(mode: str) -> str:
    """The worker builds a DDP model for every bench mode that is not its own (Horovod's
    optimizer for bsrun-horovod-fixed)."""
    return mode if mode in MODES else FIXED_MODES.get(mode, "bsrun")


def compared_warmup(modes: list[str], warmup: int) -> int:
    """The warm-up every mode of one comparison gets: with an ADAPTING_MODE among them,
    SEARCH_STEPS more, so its timed steps start where its first search has settled (the
    bench compares steady states; the search's one-time cost is the adaptation's own
    figure), and all the others' start at the same step: a run's first steps can differ
    from its later ones (ResNet-50's scheduled steps 3-8 at 0.5 Gbit/s were 6% shorter than
    its later ones, BENCHMARKS.md twelfth pass), so modes timed at different steps are not
    comparable."""
    return warmup + SEARCH_STEPS if any(m in ADAPTING_MODES for m in modes) else warmup


def launch_args(model: str, mode: str, nproc: int, bandwidth: str | None, steps: int,
                warmup: int, batch: int | None, out: Path, arch: str = "allreduce", servers: int = 1,
                profile: Path | None = None) -> list[str]:
    """bsrun's arguments for one run; only the SCHEDULED_MODES are scheduled, only the
    ADAPTING_MODES adapt. `warmup` is the whole warm-up (compared_warmup for a comparison)."""
    args = arch_flags(mode, arch, servers, profile)
    if bandwidth is not None:
        args += ["--emulate-bandwidth", bandwidth]
    args += ["-np", str(nproc), sys.executable, "-m", "bsrun.bench.worker", "--model", model,
             "--mode", worker_mode(mode), "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
    if batch is not None:
        args += ["--batch", str(batch)]
    return args


def run_once(args: list[str], mode: str, cwd: Path, out: Path, timeout: float) -> RunResult:
    """Launch `bsrun ARGS` in cwd, wait, read rank 0's result; any failure becomes RunResult.error.

    Ctrl-C stops the launch (bsrun tears down) before the caller sees it."""
    code, output = child.run(args, timeout, STOP_GRACE_S, cwd=cwd)
    if code is None:
        return RunResult(mode, error=f"did not finish in {timeout:.0f} s and was stopped\n{_tail(output)}")
    if code != 0:
        return RunResult(mode, error=f"exited with code {code}\n{_tail(output)}")
    try:
        info = json.loads(out.read_text())
        times = [float(t) for t in info["step_times"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return RunResult(mode, error=f"left no valid result in {out} ({e})\n{_tail(output)}")
    run = read_last_run(cwd)
    return RunResult(mode, times, info, "/".join(rank_modes(run)) if run else None, kept=_kept_point(run),
                     late_decisions=_late_decisions(run, info.get("warmup", 0)), first_keep=_first_keep(run))


def _kept_point(run: dict | None) -> str | None:
    """From the summary bsrun leaves in its folder: the point rank 0's adaptation ended on,
    and why (its last "keep": what the search measured)."""
    adapt = decider_adaptation(run)
    if not adapt or adapt.get("state") == "off":
        return None
    where = " on DDP's own reducer" if adapt.get("ddp_reducer") else ""
    keeps = _keeps(run)
    why = f": {keeps[-1]['why']}" if keeps else ""
    return f"{describe_point(adapt['point'])}{where} ({adapt['state']}{why})"


def _first_keep(run: dict | None) -> int | None:
    """The step of rank 0's first "keep": where its first search ended (None: it did not)."""
    keeps = _keeps(run)
    return keeps[0]["step"] if keeps else None


def _keeps(run: dict | None) -> list[dict]:
    """Rank 0's adaptation decisions that kept a point, in order."""
    adapt = decider_adaptation(run) or {}
    return [d for d in adapt.get("switches", []) if d["why"].startswith("keep")]


def _late_decisions(run: dict | None, warmup: int) -> list[str]:
    """Rank 0's adaptation decisions after the warm-up (a search or a drift re-check
    among the timed steps), as `step N: why`: what a slower adaptive median may owe."""
    adapt = decider_adaptation(run) or {}
    return [f"step {d['step']}: {d['why']}" for d in adapt.get("switches", []) if d["step"] >= warmup]


def profile_args(folder: Path, model: str, mode: str, bandwidth: str | None, steps: int, warmup: int,
                 batch: int | None, out: Path, record_steps: int | None = None, nproc: int = 2,
                 arch: str = "allreduce", servers: int = 1) -> list[str]:
    """`bsrun profile` of one bench run: the same launch, recorded into `folder`."""
    profile = ["profile", "-o", str(folder), "--warmup", str(warmup)]
    if record_steps:
        profile += ["--steps", str(record_steps)]
    return profile + launch_args(model, mode, nproc, bandwidth, steps, warmup, batch, out, arch, servers)


def profile_fixed(folder: Path, model: str, nproc: int, bandwidth: str | None, batch: int | None, cwd: Path,
                  warmup: int, record_steps: int, arch: str = "allreduce", servers: int = 1) -> str | None:
    """`bsrun profile` of the bench job as bsrun-fixed runs it (no adaptation, so the
    recorded steps are of one configuration), `record_steps` after `warmup`, into
    `folder`; the recording ends the job. None, or why it failed with the output's tail."""
    args = profile_args(folder, model, "bsrun-fixed", bandwidth, warmup + record_steps + 1, warmup, batch,
                        cwd / "profile-run.json", record_steps=record_steps, nproc=nproc, arch=arch, servers=servers)
    code, output = child.run(args, run_timeout_s(record_steps, warmup), STOP_GRACE_S, cwd=cwd)
    if code == 0:
        return None
    return f"{'did not finish' if code is None else f'exited with code {code}'}\n{_tail(output)}"


def profile_for_tac(model: str, nproc: int, bandwidth: str | None, batch: int | None, cwd: Path,
                    arch: str, servers: int) -> Path:
    """`bsrun:tac` orders by a profile of the same job on the same network (profile_fixed:
    its recorded steps are of the configuration `bsrun:tac` runs, not of adaptation's trials)."""
    folder = cwd / f"profile-{model}-{bandwidth or 'loopback'}"
    error = profile_fixed(folder, model, nproc, bandwidth, batch, cwd, 2, 4, arch, servers)
    if error is not None:
        raise BsrunError(f"the profile for bsrun:tac failed: {error}")
    return folder
