"""SchedConfig: the one place scheduling knobs are defined, parsed and resolved.

Every knob has one row in KNOBS: its command-line flag, its BSRUN_* variable, its
default and its help. That row alone makes the launch commands' option (cli.py), the
variable a worker reads (`to_env`/`from_env`), the key of `as_dict` (dry run, run
summary) and its place in resolution; a new knob is that row and its SchedConfig field. Resolution order is flag > --config file > BSRUN_* environment > committed
tuned config (.bsrun/tuned.json) > default, and the source of each value is kept so that
`--dry-run` can say where a value came from. A knob the user fixed (flag, file or env) is
left out of tuning. Workers rebuild the config from the BSRUN_* variables the launcher
exported; nothing else in bsrun reads those variables.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from bsrun.errors import BsrunError
from bsrun.fsutil import move_aside

TUNED_FILE = Path(".bsrun") / "tuned.json"

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9,
    "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """`4MB` (10^6), `512KiB` / `512K` (2^10), `1048576` -> bytes; a positive whole count."""
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError("a size such as 4MB")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError("a positive size such as 4MB")
    return value


UNLIMITED_CREDIT = 2**62


@dataclass(frozen=True)
class Credit:
    """The credit window: a byte count, or a multiple of the partition size (`4x`)."""

    bytes: int | None = None
    times: float | None = None

    def resolve(self, partition: int) -> int:
        return self.bytes if self.bytes is not None else max(1, int(self.times * partition))

    def __str__(self) -> str:
        return f"{self.times:g}x" if self.times is not None else str(self.bytes)


def parse_credit(text: str) -> Credit:
    text = str(text).strip()
    if text.lower().endswith("x"):
        try:
            times = float(text[:-1])
        except ValueError:
            raise ValueError("a size such as 16MB or a multiple of the partition such as 4x") from None
        if times <= 0:
            raise ValueError("a positive multiple of the partition such as 4x")
        return Credit(times=times)
    try:
        return Credit(bytes=parse_size(text))
    except ValueError:
        raise ValueError("a size such as 16MB or a multiple of the partition such as 4x") from None


def parse_bool(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("one of 1/0, true/false, yes/no, on/off")


def parse_partition(text: str) -> int:
    """A size, or `tensor`: one partition per gradient tensor, none cut or fused (0)."""
    if str(text).strip().lower() in ("tensor", "0"):
        return 0
    try:
        return parse_size(text)
    except ValueError:
        raise ValueError("a size such as 4MB, or tensor") from None


ARCHS = ("allreduce", "ps")
ORDERS = ("forward", "tic", "tac", "fifo")


def parse_choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = str(text).strip().lower()
        if value not in choices:
            raise ValueError(f"one of {', '.join(choices)}")
        return value
    return parse


def parse_order(text: str) -> str:
    """forward, tic, fifo, or tac / tac:DIR (the profile whose times TAC orders by)."""
    name, _, folder = str(text).strip().partition(":")
    parse_choice(ORDERS)(name)
    if folder and name != "tac":
        raise ValueError("forward, tic, fifo, tac or tac:PROFILE_DIR")
    return f"{name.lower()}:{folder}" if folder else name.lower()


def parse_whole(minimum: int, example: str) -> Callable[[str], int]:
    """A parser of whole numbers from `minimum` up."""
    def parse(text: str) -> int:
        try:
            value = int(str(text).strip())
        except ValueError:
            raise ValueError(f"a whole number such as {example}") from None
        if value < minimum:
            raise ValueError(f"at least {minimum}")
        return value
    return parse


parse_count = parse_whole(1, "2")
parse_every = parse_whole(0, "100 (0: never)")


def parse_seconds(text: str) -> float:
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|min)?\s*$", str(text))
    if not m:
        raise ValueError("a duration in seconds such as 300 or 5m")
    value = float(m.group(1)) * (60 if m.group(2) in ("m", "min") else 1)
    if value <= 0:
        raise ValueError("a positive duration such as 300")
    return value


def _bool_text(value: bool) -> str:
    return "1" if value else "0"


def _seconds_text(value: float) -> str:
    return f"{value:g}"


@dataclass(frozen=True)
class Knob:
    name: str    # the SchedConfig field, the as_dict key and the CLI option's parameter
    flag: str    # the option; "--on/--off" for a switch
    env: str
    parse: Callable[[str], Any]
    default: str
    help: str
    text: Callable[[Any], str] = str  # a parsed value as `parse` reads it back (to_env)

    @property
    def flag_name(self) -> str:
        """The flag an error message names (for a switch, the one that can be given a value)."""
        return self.flag.split("/")[-1]


KNOBS: tuple[Knob, ...] = (
    Knob("enabled", "--schedule/--no-schedule", "BSRUN_ENABLE", parse_bool, "1",
         "schedule gradient communication; --no-schedule runs the same launch as the baseline", _bool_text),
    Knob("partition", "--partition", "BSRUN_PARTITION", parse_partition, "4MiB",
         "largest piece of gradient sent in one collective (4MB, 512KiB, bytes; "
         "tensor: each tensor whole, and a credit given as a multiple is then unlimited)"),
    Knob("credit", "--credit", "BSRUN_CREDIT", parse_credit, "2x",
         "most bytes in flight at once (16MB) or a multiple of the partition (4x)"),
    Knob("timeout", "--timeout", "BSRUN_TIMEOUT", parse_seconds, "300",
         "seconds a collective may take before the job is ended as hung", _seconds_text),
    Knob("order", "--order", "BSRUN_ORDER", parse_order, "forward",
         "transfer priority: forward (first use in the next forward pass), tic (TicTac, from "
         "the dependency graph), tac[:PROFILE_DIR] (TicTac, from a profile's times; default "
         "the newest), fifo (as gradients become ready)"),
    Knob("arch", "--arch", "BSRUN_ARCH", parse_choice(ARCHS), "allreduce",
         "allreduce, or ps: workers push partitions to parameter servers and pull the sums"),
    Knob("servers", "--servers", "BSRUN_SERVERS", parse_count, "1",
         "parameter servers with --arch ps (each its own host on an emulated network)"),
    Knob("check_every", "--check-every", "BSRUN_CHECK_EVERY", parse_every, "100",
         "every N optimizer steps the ranks compare checksums of their parameters and a rank "
         "that differs ends the job (0: never)"),
    Knob("adapt", "--adapt/--no-adapt", "BSRUN_ADAPT", parse_bool, "1",
         "adapt online: during the first steps rank 0 times a few configurations (one behaves "
         "like the unscheduled run) and every rank keeps the fastest; re-checked when the step "
         "time drifts; --no-adapt keeps the configuration as given", _bool_text),
)
KNOB_BY_NAME = {k.name: k for k in KNOBS}
TUNABLE = ("partition", "credit")


@dataclass
class SchedConfig:
    enabled: bool
    partition: int
    credit: Credit
    timeout: float
    order: str = "forward"
    arch: str = "allreduce"
    servers: int = 1
    check_every: int = 100
    adapt: bool = True
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def credit_bytes(self) -> int:
        """With whole tensors (partition 0) a multiple has nothing to multiply: no limit."""
        if self.partition == 0 and self.credit.times is not None:
            return UNLIMITED_CREDIT
        return self.credit.resolve(self.partition)

    def fixed_by_user(self) -> set[str]:
        """Knobs set by flag, file or environment: tuning must leave them alone."""
        return {n for n, s in self.sources.items() if s.split(" ")[0] in ("flag", "config", "env")}

    def to_env(self) -> dict[str, str]:
        """The BSRUN_* variables that make a worker see exactly this config."""
        env = {k.env: k.text(getattr(self, k.name)) for k in KNOBS}
        env["BSRUN_CONFIG_SOURCES"] = json.dumps(self.sources, sort_keys=True)
        return env

    def as_dict(self) -> dict[str, Any]:
        """Every knob JSON-ready (the credit also in bytes) and where each value came from."""
        shown: dict[str, Any] = {}
        for knob in KNOBS:
            value = getattr(self, knob.name)
            shown[knob.name] = value if isinstance(value, (bool, int, float, str)) else knob.text(value)
            if knob.name == "credit":
                shown["credit_bytes"] = self.credit_bytes
        return {**shown, "sources": dict(self.sources)}

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "SchedConfig":
        """Inside a worker: the launcher has exported every knob; defaults cover the rest."""
        config = resolve(env=env)
        try:
            config.sources = json.loads(env.get("BSRUN_CONFIG_SOURCES", "")) or config.sources
        except ValueError:
            pass
        return config


def _parse(knob: Knob, raw: str, where: str) -> Any:
    try:
        return knob.parse(raw)
    except ValueError as e:
        raise BsrunError(f"{where} must be {e}, got {str(raw)!r}") from None


def load_config_file(path: Path) -> dict[str, str]:
    """A TOML file of knob = value lines, e.g. `partition = "4MB"`."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise BsrunError(f"cannot read --config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise BsrunError(f"--config {path} is not valid TOML: {e}") from None
    data = data.get("bsrun", data)
    unknown = sorted(set(data) - set(KNOB_BY_NAME))
    if unknown:
        raise BsrunError(f"--config {path} has unknown keys {', '.join(unknown)}; "
                         f"known: {', '.join(KNOB_BY_NAME)}")
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in data.items()}


def resolve(flags: Mapping[str, str | None] | None = None,
            config_file: Path | None = None,
            env: Mapping[str, str] = os.environ,
            tuned: Mapping[str, str] | None = None,
            tuned_label: str = str(TUNED_FILE)) -> SchedConfig:
    """Apply flag > config file > env > tuned > default to every knob, keeping sources."""
    flags = flags or {}
    from_file = load_config_file(config_file) if config_file else {}
    tuned = tuned or {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for knob in KNOBS:
        if flags.get(knob.name) is not None:
            raw, source, where = flags[knob.name], "flag", knob.flag_name
        elif knob.name in from_file:
            raw, source, where = from_file[knob.name], f"config {config_file}", f"{knob.name} in {config_file}"
        elif env.get(knob.env, "") != "":
            raw, source, where = env[knob.env], f"env {knob.env}", knob.env
        elif knob.name in tuned:
            raw, source, where = tuned[knob.name], f"tuned {tuned_label}", f"{knob.name} in {tuned_label}"
        else:
            raw, source, where = knob.default, "default", knob.name
        values[knob.name] = _parse(knob, raw, where)
        sources[knob.name] = source
    return SchedConfig(sources=sources, **values)


def job_signature(command: list[str], world_size: int, hosts: list[str] | None = None) -> str:
    """Same job = same command, world size and hosts: the key of a tuned config."""
    blob = json.dumps({"command": list(command), "world_size": world_size,
                       "hosts": sorted(hosts or ["localhost"])}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def load_tuned(signature: str, path: Path = TUNED_FILE) -> dict[str, str]:
    """The committed config of this job, or {}; a corrupt file is moved aside with a warning."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        entry = data["jobs"].get(signature)
        if entry is None:
            return {}
        config = {k: str(v) for k, v in entry.get("config", {}).items() if k in TUNABLE}
        if not isinstance(entry.get(LEARNED_KEY, {}).get("point", {}), dict):
            raise ValueError("a learned point that is not a mapping")
    except (ValueError, KeyError, TypeError, AttributeError):
        aside = move_aside(path)
        print(f"bsrun: warning: {path} is corrupt; moved it to {aside} and using defaults",
              file=sys.stderr)
        return {}
    return config


LEARNED_KEY = "adapted"  # a job's entry in tuned.json: the point online adaptation kept last


def load_learned(signature: str, path: Path = TUNED_FILE) -> dict | None:
    """The point the last adapted run of this job kept (see bsrun/sched/adaptive.py), or None.
    Read after `load_tuned`, which has moved a corrupt file aside (with its warning)."""
    try:
        return json.loads(Path(path).read_text())["jobs"][signature][LEARNED_KEY]["point"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


# Variables of the launcher-to-worker contract that are not knobs.
ACTIVE_ENV = "BSRUN_ACTIVE"              # "1": the bsrun sitecustomize installs the bootstrap
REPORT_DIR_ENV = "BSRUN_REPORT_DIR"      # where each rank writes its part of the run summary
LAUNCHER_PID_ENV = "BSRUN_LAUNCHER_PID"  # the bsrun that started the launch: its workers end when it is gone
PACKAGE_ROOT_ENV = "BSRUN_PACKAGE_ROOT"  # lets a worker's Python find bsrun if not installed there
ADAPT_START_ENV = "BSRUN_ADAPT_START"    # JSON: the point an earlier run of the job learned
DEBUG_ENV = "BSRUN_DEBUG"                # "1": workers say what the bootstrap did
WORKER_PID_ENV = "BSRUN_WORKER_PID"      # set by the training worker, so its children stand aside
# A tuning trial (`bsrun tune`): set only in the environment of a trial's launch.
TRIAL_OUT_ENV = "BSRUN_TRIAL_OUT"        # rank 0 writes the trial's measurement here (JSON)
TRIAL_WARMUP_ENV = "BSRUN_TRIAL_WARMUP"  # optimizer steps before timing starts
TRIAL_STEPS_ENV = "BSRUN_TRIAL_STEPS"    # timed steps; the job ends after warm-up + these
TRIAL_ID_ENV = "BSRUN_TRIAL_ID"          # the trial's number in the journal (for logs, tests)
# A profile (`bsrun profile`): set only in the environment of a profiled launch.
PROFILE_DIR_ENV = "BSRUN_PROFILE_DIR"        # each rank appends its recording to rank-<r>.jsonl here
PROFILE_WARMUP_ENV = "BSRUN_PROFILE_WARMUP"  # optimizer steps before recording starts
PROFILE_STEPS_ENV = "BSRUN_PROFILE_STEPS"    # recorded steps; the job ends after warm-up + these

# --arch ps: where workers and parameter servers meet (bsrun/sched/ps_protocol.py).
PS_ADDR_ENV = "BSRUN_PS_ADDR"        # server 0's address: it holds the group's store
PS_PORT_ENV = "BSRUN_PS_PORT"
PS_WORKERS_ENV = "BSRUN_PS_WORKERS"  # N: workers are ranks 0..N-1 of the group
PS_SERVERS_ENV = "BSRUN_PS_SERVERS"  # K: servers are ranks N..N+K-1
PS_RANK_ENV = "BSRUN_PS_RANK"        # a server's rank in the group


def worker_setting(name: str, env: Mapping[str, str] = os.environ) -> str | None:
    """Read one contract variable inside a worker (the only other env read bsrun does)."""
    return env.get(name) or None
