"""Shared helpers: run the real `bsrun` command in a scratch folder."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
WORKERS = REPO / "tests" / "workers"


def bsrun_env(**extra):
    env = dict(os.environ)
    env.pop("BSRUN_ACTIVE", None)
    env["OMP_NUM_THREADS"] = "1"
    for key, value in extra.items():  # None removes a variable
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_as_group(argv, timeout, **kwargs) -> subprocess.CompletedProcess:
    """A command run WITHOUT bsrun (torchrun, horovodrun: launchers whose workers outlive a
    killed launcher), text output captured, in a session of its own: on timeout the whole
    group it started is killed, not the launcher alone, and TimeoutExpired is raised."""
    with subprocess.Popen(list(map(str, argv)), start_new_session=True, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group of the process we started
            proc.communicate()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

def run_bsrun(args, cwd, timeout=120, env=None, check=False):
    """`python -m bsrun ARGS` in cwd; returns the CompletedProcess (text)."""
    proc = subprocess.run([sys.executable, "-m", "bsrun", *map(str, args)], cwd=cwd,
                          env=env or bsrun_env(), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise AssertionError(f"bsrun {args} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n"
                             f"--- stderr\n{proc.stderr}")
    return proc


def start_bsrun(args, cwd, env=None):
    """bsrun in the background, for tests that signal it (`env`: variables added)."""
    return subprocess.Popen([sys.executable, "-m", "bsrun", *map(str, args)], cwd=cwd, env={**bsrun_env(), **(env or {})},
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def signal_when(proc, ready, signum, what, settle=0.0, timeout=30):
    """Send `signum` to bsrun once ready() holds (then `settle` s); return (exit code, stderr)."""
    try:
        deadline = time.monotonic() + timeout
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready(), f"{what} did not happen within {timeout} s"
        time.sleep(settle)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def bsrun_namespaces(owner=None):
    """The namespaces of bsrun process `owner`, or, without one, those whose owner has
    exited: leftovers (a concurrent live run's are not)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.startswith("bsrun-")]
    owners = {n: int(n.split("-")[1]) for n in names}
    if owner is not None:
        return [n for n in names if owners[n] == owner]
    return [n for n in names if not psutil.pid_exists(owners[n])]


def last_run(cwd) -> dict:
    return json.loads((Path(cwd) / ".bsrun" / "last-run.json").read_text())


def assert_scheduled(run: dict, ranks: int = 2, context: str = "") -> None:
    """The run summary shows ranks 0..ranks-1, every one scheduled (not fallen back) with
    partitions and bytes sent; `context` (a worker's output) goes into the message."""
    listed = run["ranks"]
    assert [r["rank"] for r in listed] == list(range(ranks)), \
        f"expected ranks 0..{ranks - 1} in the run summary, got {listed}\n{context}"
    modes = {r["rank"]: r.get("mode") for r in listed}
    assert set(modes.values()) == {"scheduled"}, \
        f"not every rank ran scheduled: {modes} (notes: {[r.get('notes') for r in listed]})\n{context}"
    for r in listed:
        assert r.get("partitions", 0) > 0 and r.get("bytes", 0) > 0, f"rank {r['rank']} scheduled nothing: {r}\n{context}"


POINT_KEYS = {"partition", "credit_bytes", "order", "proxy"}  # an adaptation point in the run summary


def adapt_of(summary: dict, rank: int) -> dict:
    """rank's `adapt` record, its shape checked."""
    entry = summary["ranks"][rank]
    assert "adapt" in entry, f"rank {rank}'s summary has no 'adapt': {sorted(entry)}"
    adapt = entry["adapt"]
    assert adapt["state"] in ("off", "exploring", "settled"), adapt
    assert set(adapt["point"]) == POINT_KEYS, f"rank {rank}'s point: {adapt['point']}"
    for s in adapt["switches"]:
        assert set(s) >= {"step", "point", "why", "median_s"} and set(s["point"]) == POINT_KEYS, s
    return adapt


def agreed(switches: list[dict]) -> list[tuple]:
    """What every rank must share: the step of each switch and the point switched to."""
    return [(s["step"], s["point"]) for s in switches]


def show(switches: list[dict]) -> str:
    return "\n".join(f"  step {s['step']:>4}: {s['why']:<12} {s['point']} median {s['median_s']}"
                     for s in switches) or "  (none)"


def assert_same_switches(summary: dict) -> list[dict]:
    """Rank 0's and rank 1's switches: the same steps and points; rank 0's, returned."""
    a0, a1 = adapt_of(summary, 0), adapt_of(summary, 1)
    assert agreed(a0["switches"]) == agreed(a1["switches"]), \
        f"the ranks switched differently\nrank 0:\n{show(a0['switches'])}\nrank 1:\n{show(a1['switches'])}"
    steps = [s["step"] for s in a0["switches"]]
    assert steps == sorted(set(steps)) and all(s >= 1 for s in steps), f"switch steps not increasing: {steps}"
    return a0["switches"]


def assert_same_state(a, b, path="state", atol=1e-8):
    if isinstance(a, torch.Tensor):
        assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=atol), \
            f"{path} differs: max abs diff {(a.double() - b.double()).abs().max().item():.3g}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path} keys differ: {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_same_state(a[k], b[k], f"{path}.{k}", atol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path} lengths differ"
        for k, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}[{k}]", atol)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.fixture
def workdir(tmp_path):
    return tmp_path
