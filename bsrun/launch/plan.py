"""LaunchPlan: everything a launch needs, decided before any process starts.

Two kinds of launch:
- "local": `-np N python ...`: bsrun starts N Python workers itself with torchrun's
  variables (and Horovod's rendezvous, emulated hosts, parameter servers);
- "wrap": any other command (`python train.py`, torchrun, accelerate, deepspeed, a shell
  script) runs exactly as it would without bsrun, with no rank variables of bsrun's; the
  injection reaches every Python process below it through the environment, and a process
  becomes a worker where it builds a DDP model (bsrun/inject/bootstrap.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import bsrun
from bsrun.config import (ACTIVE_ENV, ADAPT_START_ENV, LAUNCHER_PID_ENV, PACKAGE_ROOT_ENV, PS_ADDR_ENV, PS_PORT_ENV, PS_RANK_ENV,
                          PS_SERVERS_ENV, PS_WORKERS_ENV, REPORT_DIR_ENV, WORKER_PID_ENV, SchedConfig)
from bsrun.errors import BsrunError
from bsrun.inject import SITE_DIR
from bsrun.launch.workers import WorkerSpec

PACKAGE_ROOT = Path(bsrun.__file__).resolve().parent.parent
FOREIGN_LAUNCHERS = ("torchrun", "horovodrun", "mpirun", "mpiexec")
_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)?)?$")


def python_path(first: Path, env: Mapping[str, str]) -> str:
    """`first`, then the PYTHONPATH of `env`: bsrun's folder is found first, the user's still are."""
    user_path = env.get("PYTHONPATH")
    return os.pathsep.join([str(first)] + ([user_path] if user_path else []))


def is_python(executable: str) -> bool:
    return bool(_PYTHON_RE.match(os.path.basename(executable)))


def classify(command: list[str]) -> str:
    """'python' for a Python command, 'launcher' for a known launcher, 'command' for any other."""
    if not command:
        raise BsrunError("no command given; try: bsrun -np 2 python train.py")
    exe = os.path.basename(command[0])
    if exe in FOREIGN_LAUNCHERS:
        return "launcher"
    if is_python(exe):
        if command[1:3] in (["-m", "torch.distributed.run"], ["-m", "torch.distributed.launch"]):
            return "launcher"
        return "python"
    return "command"


def check_command(command: list[str]) -> None:
    """The one refusal of a wrapped command: one that does not exist (nothing is started)."""
    if shutil.which(command[0]) is None:
        where = "" if os.sep in command[0] else " on PATH"
        raise BsrunError(f"command '{command[0]}' not found{where}; nothing was started", exit_code=127)


def check_python_command(command: list[str]) -> None:
    """Fail before starting anything when the interpreter or the script is missing."""
    if shutil.which(command[0]) is None:
        raise BsrunError(f"Python interpreter '{command[0]}' not found")
    args = command[1:]
    while args and args[0].startswith("-") and args[0] not in ("-m", "-c", "-"):
        args = args[1:]  # interpreter flags such as -u or -O
    if not args:
        raise BsrunError(f"no script given to {command[0]}; try: bsrun -np 2 python train.py")
    if args[0] in ("-m", "-c"):
        if len(args) < 2:
            raise BsrunError(f"{command[0]} {args[0]} needs an argument")
        return
    if not Path(args[0]).is_file():
        raise BsrunError(f"script '{args[0]}' not found")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class NetworkSpec:
    """An emulated network: one host (network namespace) per rank, shaped links."""

    rate_bps: int | None
    latency_s: float | None = None


@dataclass
class LaunchPlan:
    command: list[str]
    kind: str                      # "local" or "wrap"
    nproc: int                     # workers bsrun starts (local), or 1 for the wrapped command
    config: SchedConfig
    grace: float = 10.0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    base_env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    report_dir: Path | None = None  # made by the agent at launch time
    network: NetworkSpec | None = None  # emulated hosts, one per rank
    ps_port: int = 0  # --arch ps: the port of server 0's store
    adapt_start: dict | None = None  # the point an earlier run of this job learned (adaptation starts there)

    @property
    def servers(self) -> int:
        """Parameter servers this launch starts (--arch ps, local launches only)."""
        return self.config.servers if self.config.arch == "ps" and self.kind == "local" else 0

    @property
    def hosts(self) -> int:
        """Emulated hosts: one per worker, then one per server."""
        return self.nproc + self.servers

    def injection_env(self) -> dict[str, str]:
        """The environment that switches bsrun on in every Python process below."""
        env = dict(self.base_env, PYTHONPATH=python_path(SITE_DIR, self.base_env))
        env[ACTIVE_ENV] = "1"
        env[LAUNCHER_PID_ENV] = str(os.getpid())
        env[PACKAGE_ROOT_ENV] = str(PACKAGE_ROOT)
        env.pop(WORKER_PID_ENV, None)  # a fresh launch: no process below it is a worker's child yet
        if self.report_dir is not None:
            env[REPORT_DIR_ENV] = str(self.report_dir)
        env.update(self.config.to_env())
        env.pop(ADAPT_START_ENV, None)
        if self.adapt_start is not None and self.config.adapt:
            env[ADAPT_START_ENV] = json.dumps(self.adapt_start, sort_keys=True)
        return env

    def rank_env(self, rank: int) -> dict[str, str]:
        """torchrun's variables for one local worker, on top of the injection."""
        env = self.injection_env()
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                   WORLD_SIZE=str(self.nproc), LOCAL_WORLD_SIZE=str(self.nproc),
                   ROLE_WORLD_SIZE=str(self.nproc), MASTER_ADDR=self.master_addr,
                   MASTER_PORT=str(self.master_port), TORCHELASTIC_RUN_ID="bsrun")
        if self.nproc > 1 and "OMP_NUM_THREADS" not in self.base_env:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun does: N workers share the cores
        return env

    def ps_env(self, net=None) -> dict[str, str]:
        """Where the workers and the servers meet (server 0 holds the store)."""
        if not self.servers:
            return {}
        return {PS_ADDR_ENV: net.hosts[self.nproc].addr if net is not None else "127.0.0.1",
                PS_PORT_ENV: str(self.ps_port), PS_WORKERS_ENV: str(self.nproc), PS_SERVERS_ENV: str(self.servers)}

    def server_specs(self, net=None) -> list[WorkerSpec]:
        """The parameter servers, ranks nproc.. of the PS group; not injected (they run no script)."""
        specs = []
        for s in range(self.servers):
            rank = self.nproc + s
            env = dict(self.base_env, **self.ps_env(net), **{PS_RANK_ENV: str(rank)},
                       PYTHONPATH=python_path(PACKAGE_ROOT, self.base_env))
            env.setdefault("OMP_NUM_THREADS", "1")
            argv = [sys.executable, "-m", "bsrun.sched.ps_server"]
            if net is not None:
                argv = net.wrap(rank, argv)
                env.update(net.env_for(rank))
            specs.append(WorkerSpec(rank=rank, argv=argv, env=env, prefix=f"[server {s}] ",
                                    service=f"parameter server {s}"))
        return specs

    def worker_specs(self, net=None, horovod=None) -> list[WorkerSpec]:
        """One spec per process; on an emulated network `net`, each rank in its own host;
        with a HorovodRendezvous `horovod`, Horovod's variables too; with --arch ps, the
        servers too."""
        if self.kind == "wrap":
            return [WorkerSpec(rank=0, argv=list(self.command), env=self.injection_env())]
        specs = []
        for r in range(self.nproc):
            argv, env = list(self.command), self.rank_env(r)
            if net is not None:
                argv = net.wrap(r, argv)
                env.update(net.env_for(r), MASTER_ADDR=net.master_addr)
            if horovod is not None:
                env.update(horovod.env_for(r))
            env.update(self.ps_env(net))
            specs.append(WorkerSpec(rank=r, argv=argv, env=env, prefix=f"[{r}] " if self.hosts > 1 else None))
        return specs + self.server_specs(net)


def make_plan(command: list[str], nproc: int | None, config: SchedConfig,
              grace: float = 10.0, network: NetworkSpec | None = None) -> LaunchPlan:
    """`-np N python ...`: a local launch; any other command: a wrap, run as given."""
    kind = classify(command)
    if nproc is not None and nproc < 1:
        raise BsrunError(f"-np must be at least 1, got {nproc}")
    if kind != "python" or nproc is None:
        own = "-np N python ...` (bsrun's own launcher"
        if nproc is not None:
            what = "takes its own process count" if kind == "launcher" else "is not Python"
            raise BsrunError(f"-np goes with `python ...`; {os.path.basename(command[0])} {what}")
        if network is not None:
            raise BsrunError(f"--emulate-bandwidth goes with `{own}, one emulated host per rank)")
        if config.arch == "ps":
            raise BsrunError(f"--arch ps goes with `{own}: bsrun starts the servers itself)")
        check_command(command)
        return LaunchPlan(command, "wrap", 1, config, grace)
    if config.arch == "ps" and config.enabled is False:
        raise BsrunError("--arch ps schedules through parameter servers; it cannot go with --no-schedule")
    check_python_command(command)
    return LaunchPlan(command, "local", nproc, config, grace, master_port=free_port(), network=network,
                      ps_port=free_port() if config.arch == "ps" else 0)
