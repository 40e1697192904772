"""Commit the winning config of a job to `.bsrun/tuned.json`, where every later run reads it.

The file is `{"jobs": {SIGNATURE: {"config": {...}, ...}}}`, keyed by the job signature
(command, world size, hosts; config.job_signature), written atomically. Only the searched
knobs are committed; a knob the user fixed stays the user's. `config.load_tuned` reads
it back in `bsrun run`, and `--dry-run` shows "tuned .bsrun/tuned.json" as the source.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bsrun.config import TUNED_FILE, load_tuned
from bsrun.fsutil import atomic_write_json


def commit(signature: str, config: dict[str, str], details: dict, path: Path = TUNED_FILE) -> Path:
    """Write `config` as the job's tuned config, keeping every other job's entry."""
    path = Path(path)
    load_tuned(signature, path)  # a corrupt file is moved aside here, with a warning
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        data = {}
    jobs = data.get("jobs") if isinstance(data.get("jobs"), dict) else {}
    jobs[signature] = {"config": dict(config), "committed": time.strftime("%Y-%m-%dT%H:%M:%S"), **details}
    atomic_write_json(path, {**data, "jobs": jobs})
    return path
