"""Commit the winning config of a job to `.bsrun/tuned.json`, where every later run reads it.

The file is `{"jobs": {SIGNATURE: {"config": {...}, ..., "adapted": {"point": {...}, ...}}}}`,
keyed by the job signature (command, world size, hosts; config.job_signature), written
atomically. Only the searched knobs are committed; a knob the user fixed stays the
user's. `config.load_tuned` reads it back in `bsrun run`, and `--dry-run` shows "tuned
.bsrun/tuned.json" as the source. "adapted" is the point the job's last adapted run kept
(`config.load_learned`): its next launch starts adapting there.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bsrun.config import LEARNED_KEY, TUNED_FILE, load_tuned
from bsrun.fsutil import atomic_write_json


def commit(signature: str, config: dict[str, str], details: dict, path: Path = TUNED_FILE) -> Path:
    """Write `config` as the job's tuned config, keeping every other job's entry. A point an
    earlier run learned online is dropped: the new search result is where adaptation starts."""
    return _write_entry(signature, path, lambda _old: {"config": dict(config), "committed": _now(), **details})


def commit_learned(signature: str, point: dict, details: dict, path: Path = TUNED_FILE) -> Path:
    """Keep the point online adaptation kept (bsrun/inject/adapt.py) beside the job's tuned
    config, which stays: the next launch of the job starts adapting from this point."""
    return _write_entry(signature, path, lambda old: {**old, LEARNED_KEY: {"point": dict(point),
                                                                           "committed": _now(), **details}})


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def _write_entry(signature: str, path: Path, new_entry) -> Path:
    path = Path(path)
    load_tuned(signature, path)  # a corrupt file is moved aside here, with a warning
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        data = {}
    jobs = data.get("jobs") if isinstance(data.get("jobs"), dict) else {}
    old = jobs.get(signature)
    jobs[signature] = new_entry(old if isinstance(old, dict) else {})
    atomic_write_json(path, {**data, "jobs": jobs})
    return path
