"""The rich Console every bsrun command prints its tables through.

On a terminal, rich fits a table to the screen. Off one (piped into a log, written to
a file) rich would assume 80 columns, wrap the table and cut its labels ("bandw…");
there nothing needs fitting, so every table prints whole, at its own full width.
"""

from __future__ import annotations

from typing import IO

from rich.console import Console

WHOLE_WIDTH = 1000  # off a terminal: wider than any bsrun table, which is only as wide as it needs


def new_console(stderr: bool = False, file: IO[str] | None = None) -> Console:
    """A Console on stdout (stderr, or `file`); off a terminal, wide enough for whole tables."""
    console = Console(stderr=stderr, file=file)
    if console.file.isatty():  # not rich's is_terminal: FORCE_COLOR makes a pipe one
        return console
    # A height too: given only a width, rich still prints 80 columns for TERM=dumb.
    return Console(stderr=stderr, file=file, width=WHOLE_WIDTH, height=console.height)
