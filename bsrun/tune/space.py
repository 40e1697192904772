"""The search space of `bsrun tune`: which knobs are searched, over which ranges.

Both knobs are searched on log scales (a partition twice as large matters about as
much at 128 KiB as at 32 MiB): the partition in bytes, the credit as a multiple of the
partition. A knob the user fixed (flag, --config file or BSRUN_* variable) is left out
of the search and kept as the user set it in every trial, as Horovod's autotune does.

A point is a list of log2 values, one per searched knob, in `Space.names` order; a
config is what a trial passes on bsrun's command line (`{"partition": "4MiB",
"credit": "2x"}`) and what is committed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bsrun.config import KNOB_BY_NAME, TUNABLE, parse_credit, parse_size
from bsrun.errors import BsrunError

DEFAULT_RANGES = {"partition": (64 * 2**10, 128 * 2**20), "credit": (1.0, 16.0)}
GRID_STEPS = {"partition": 2.0, "credit": 1.0}  # log2 steps of `--grid`: partition x4, credit x2
SPACE_HELP = "partition=64KiB:128MiB,credit=1x:16x"


def format_size(n: int) -> str:
    """Bytes as bsrun's size syntax reads them back exactly: 4MiB, 2944KiB, 1000B."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def format_credit(times: float) -> str:
    return f"{times:g}x"


@dataclass(frozen=True)
class Space:
    """The searched knobs (a subset of TUNABLE) and their ranges; `fixed`: the user's."""

    ranges: dict[str, tuple[float, float]]
    fixed: dict[str, str] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [n for n in TUNABLE if n in self.ranges and n not in self.fixed]

    def dimensions(self):
        from skopt.space import Real

        return [Real(math.log2(lo), math.log2(hi), name=name) for name, (lo, hi) in self._searched()]

    def _searched(self):
        return [(n, self.ranges[n]) for n in self.names]

    def config(self, point) -> dict[str, str]:
        """The knobs a trial sets for this point, rounded to 8 steps per octave for the
        partition (224KiB, 120MiB), 2 digits for the credit (1.4x): finer than any
        measurement can tell apart, and readable."""
        config = {}
        for name, value in zip(self.names, point):
            if name == "partition":
                quantum = 2 ** max(10, math.floor(value) - 3)
                config[name] = format_size(max(1, round(2**value / quantum)) * quantum)
            else:
                config[name] = format_credit(float(f"{2**value:.2g}"))
        return config

    def point(self, config: dict[str, str]) -> list[float]:
        """The inverse of config(), clipped into the ranges."""
        point = []
        for name, (lo, hi) in self._searched():
            value = parse_size(config[name]) if name == "partition" else parse_credit(config[name]).times
            point.append(math.log2(min(max(value, lo), hi)))
        return point

    def defaults(self) -> dict[str, str]:
        """bsrun's defaults of the searched knobs, as a config of this space."""
        return self.config(self.point({n: KNOB_BY_NAME[n].default for n in self.names}))

    def grid(self) -> list[dict[str, str]]:
        """Every combination of log-spaced values (GRID_STEPS), both ends included."""
        axes = []
        for name, (lo, hi) in self._searched():
            a, b, step = math.log2(lo), math.log2(hi), GRID_STEPS[name]
            values = [a + i * step for i in range(int((b - a) / step + 1e-9) + 1)]
            if b - values[-1] > 1e-9:
                values.append(b)
            axes.append(values)
        points = [[]]
        for values in axes:
            points = [p + [v] for p in points for v in values]
        return [self.config(p) for p in points]

    def describe(self) -> dict:
        """What the journal keeps to tell whether a later run searches the same space."""
        return {"searched": {n: [format_size(int(lo)) if n == "partition" else format_credit(lo),
                                 format_size(int(hi)) if n == "partition" else format_credit(hi)]
                             for n, (lo, hi) in self._searched()},
                "fixed": dict(self.fixed)}


def parse_space(text: str | None, fixed: dict[str, str]) -> Space:
    """`partition=64KiB:128MiB,credit=1x:16x` (either part may be left out) -> Space."""
    ranges = dict(DEFAULT_RANGES)
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, _, bounds = part.partition("=")
        name = name.strip()
        lo_text, sep, hi_text = bounds.partition(":")
        if name not in TUNABLE or not sep:
            raise BsrunError(f"--space must look like {SPACE_HELP}, got {part.strip()!r}")
        try:
            if name == "partition":
                lo, hi = parse_size(lo_text), parse_size(hi_text)
            else:
                lo, hi = parse_credit(lo_text).times, parse_credit(hi_text).times
                if lo is None or hi is None:
                    raise ValueError
        except (ValueError, TypeError):
            what = "sizes such as 64KiB" if name == "partition" else "multiples of the partition such as 1x"
            raise BsrunError(f"--space {name} bounds must be {what}, got {bounds!r}") from None
        if not lo < hi:
            raise BsrunError(f"--space {name}: the lower bound must be below the upper, got {bounds!r}")
        ranges[name] = (lo, hi)
    space = Space(ranges, dict(fixed))
    if not space.names:
        raise BsrunError(f"nothing to tune: {' and '.join(sorted(fixed))} "
                         f"{'are' if len(fixed) > 1 else 'is'} fixed by the user")
    return space
