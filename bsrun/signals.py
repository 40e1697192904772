"""SIGINT and SIGTERM while a block of bsrun runs: an exception, or a call once someone takes them.

A launch and a tuning run both stop cleanly on Ctrl-C or SIGTERM: the exception unwinds
through every `finally` (a trial stops its launch, the launcher removes its network),
and the launcher, once its workers run, hands the signal to them instead (they stop and
are reported). The handlers that were there before come back when the block ends.
"""

from __future__ import annotations

import signal
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """SIGINT or SIGTERM arrived while a StopSignals block ran."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """`with StopSignals() as stop:` SIGINT/SIGTERM raise Stopped in the main thread, or,
    once `stop.forward_to` is set, call it with the signal number instead."""

    def __init__(self):
        self.forward_to: Callable[[int], None] | None = None

    def _handle(self, signum, _frame):
        if self.forward_to is None:
            raise Stopped(signum)
        self.forward_to(signum)

    def __enter__(self) -> "StopSignals":
        self.previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
