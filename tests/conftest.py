"""Shared helpers: run the real `bsrun` command in a scratch folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def run_bsrun(args, cwd, timeout=120, env=None, check=False):
    """`python -m bsrun ARGS` in cwd; returns the CompletedProcess (text)."""
    proc = subprocess.run([sys.executable, "-m", "bsrun", *map(str, args)], cwd=cwd,
                          env=env or bsrun_env(), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise AssertionError(f"bsrun {args} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n"
                             f"--- stderr\n{proc.stderr}")
    return proc


def last_run(cwd) -> dict:
    return json.loads((Path(cwd) / ".bsrun" / "last-run.json").read_text())


@pytest.fixture
def workdir(tmp_path):
    return tmp_path
