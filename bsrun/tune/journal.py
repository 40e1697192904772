"""The tuning journal: `.bsrun/tune/<job>.jsonl`, one JSON record a line, append-only.

The first line describes the job and the search space; then one line per trial
(search, recheck or grid), appended and flushed to disk as soon as the trial ends, and
a line per commit. State lives here: resuming a tuning run is replaying its journal,
so a run killed at any moment (Ctrl-C, SIGTERM, SIGKILL) leaves a valid file and the
same command picks up where it stopped. A trial that was running when the tuner died
has no line and is run again.

A file that cannot be read back is moved aside (kept for inspection) with a warning,
as a corrupt `.bsrun/tuned.json` is; a last line cut short by a crash mid-write is
dropped with a warning.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from bsrun.errors import BsrunError
from bsrun.fsutil import atomic_write_text, move_aside

TUNE_DIR = Path(".bsrun") / "tune"
VERSION = 1


def journal_path(signature: str, folder: Path = TUNE_DIR) -> Path:
    return Path(folder) / f"{signature}.jsonl"


def _warn(message: str) -> None:
    print(f"bsrun: warning: {message}", file=sys.stderr, flush=True)


def read_records(path: Path, repair: bool = True) -> list[dict] | None:
    """The records of a journal; None when it is corrupt (moved aside if `repair`)."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    records = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "type" not in record:
                raise ValueError("not a journal record")
        except ValueError:
            if i == len(lines) - 1 and not text.endswith("\n") and records:
                if repair:  # cut short mid-write: everything before it is intact
                    _warn(f"{path}: dropped an incomplete last record")
                    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
                break
            if repair:
                aside = move_aside(path)
                _warn(f"{path} is corrupt (line {i + 1}); moved it to {aside} and starting a new journal")
            return None
        records.append(record)
    if records and (records[0].get("type") != "job" or records[0].get("version") != VERSION):
        if repair:
            aside = move_aside(path)
            _warn(f"{path} does not start with a job record of version {VERSION}; moved it to {aside} "
                  f"and starting a new journal")
        return None
    return records


class Journal:
    """An open journal: its records so far, and `append` for the next one."""

    def __init__(self, path: Path, records: list[dict]):
        self.path = Path(path)
        self.records = records

    @classmethod
    def open(cls, path: Path, header: dict, fresh: bool = False) -> "Journal":
        """Resume the journal at `path`, or start it with `header` (the job record).

        A journal of the same job made for another search space cannot be resumed: its
        scores were measured over other knobs; that ends in one line (use --fresh).
        """
        path = Path(path)
        if fresh and path.exists():
            path.unlink()
        records = read_records(path) or []
        header = {"type": "job", "version": VERSION, **header}
        if records:
            old = records[0]
            if old.get("space") != header["space"]:
                raise BsrunError(f"{path} was made for another search space ({json.dumps(old.get('space'))}, "
                                 f"now {json.dumps(header['space'])}); run with --fresh to start over")
            return cls(path, records)
        journal = cls(path, [])
        journal.append(header)
        return journal

    def append(self, record: dict) -> None:
        """One line, flushed and synced before this returns: a kill after it keeps the record."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(record, sort_keys=True) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.records.append(record)

    @property
    def header(self) -> dict:
        return self.records[0]

    def trials(self, *kinds: str) -> list[dict]:
        return [r for r in self.records if r.get("type") == "trial" and (not kinds or r.get("kind") in kinds)]

    def next_number(self) -> int:
        return len(self.trials()) + 1
