"""Run bsrun as a child process: both sides of that contract in one place.

Parent side (bench's launches and TAC profile, tune's trials and --presim profile, the
calibration in bsrun/bench/calibrate.py): `argv` and `env` build the child, `run` runs it
to its end or stops it, `stop` stops it as Ctrl-C would. What the child's launch did is
then read from its run summary (bsrun.launch.summary.read_last_run).

Child side: `python -m bsrun.child PARENT_PID ARGS...` asks the kernel for SIGTERM when
its parent dies, even by SIGKILL (PR_SET_PDEATHSIG on Linux: so the parent needs no
`preexec_fn`, unsafe in a process with threads), then becomes `python -m bsrun ARGS`
(execv: the same process, and the request holds across it). It imports no command of
bsrun itself, so the commands that start children are not its dependencies. SIGTERM makes
bsrun stop its workers and remove its emulated network as on any stop, so a killed
`bsrun tune` or `bsrun bench` leaves no launch running behind it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import IO, Mapping, NamedTuple, Sequence

from bsrun.config import ACTIVE_ENV
from bsrun.launch.plan import PACKAGE_ROOT, python_path

PR_SET_PDEATHSIG = 1


def argv(args: Sequence[str]) -> list[str]:
    """`bsrun ARGS` as a child of this process, which ends when this process does."""
    return [sys.executable, "-m", "bsrun.child", str(os.getpid()), *map(str, args)]


def env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment, able to find this bsrun from any folder, plus `extra`.

    BSRUN_ACTIVE is left out: the child's launcher sets it for its own workers."""
    child_env = {k: v for k, v in os.environ.items() if k != ACTIVE_ENV}
    child_env["PYTHONPATH"] = python_path(PACKAGE_ROOT, os.environ)
    child_env.update(extra or {})
    return child_env


def stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, as Ctrl-C would: bsrun stops its workers and its network; SIGKILL after grace_s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Ended(NamedTuple):
    code: int | None  # None: it ran past its timeout and was stopped
    output: str       # stdout and stderr together; "" when they went to a log file


def run(args: Sequence[str], timeout_s: float, grace_s: float, cwd=None,
        extra_env: Mapping[str, str] | None = None, log: IO | None = None) -> Ended:
    """Run `bsrun ARGS` as a child to its end, its output captured or written to `log`.

    One that runs past timeout_s is stopped (`stop`); so is one running when this process
    is interrupted (Ctrl-C, or Stopped from bsrun.signals), before the exception goes on."""
    proc = subprocess.Popen(argv(args), cwd=cwd, env=env(extra_env), stdin=subprocess.DEVNULL,
                            stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return Ended(proc.returncode, output or "")
    except subprocess.TimeoutExpired:
        stop(proc, grace_s)
        output, _ = proc.communicate()
        return Ended(None, output or "")
    except BaseException:
        stop(proc, grace_s)
        raise


def main() -> None:
    """The child: die with the parent, then become bsrun's command line."""
    parent, args = int(sys.argv[1]), sys.argv[2:]
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the parent still stops its child on SIGINT/SIGTERM
    if os.getppid() != parent:
        sys.exit(128 + signal.SIGTERM)  # the parent died before we could ask
    os.execv(sys.executable, [sys.executable, "-m", "bsrun", *args])


if __name__ == "__main__":
    main()
