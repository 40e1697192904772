"""Which config to try next, which to re-measure, which to commit.

The search is scikit-optimize's `Optimizer` (a Gaussian process with expected
improvement) driven by ask/tell. It is rebuilt from the journal before every ask,
with the same seed: resuming a tuning run and continuing one are the same code, and
the same journal always proposes the same next point. The first point is bsrun's
defaults, then INITIAL_POINTS - 1 of a Latin hypercube (or, with --presim, the points the
profile's what-if replay predicts fastest), then the model's choices.

The objective is log(step time): GP noise and differences are then relative. A failed
trial is told as twice the slowest successful one, so the model steers away from it
without one failure dominating its scale.

Noise: the best `recheck` configs of the search (bsrun's defaults always among them)
are launched once more, and the one fastest in that second measurement is committed;
its first measurement was picked for being fast, so it is biased low; a second one is not.
"""

from __future__ import annotations

import math
import warnings

from bsrun.tune.space import Space

INITIAL_POINTS = 4  # defaults + 3 space-filling points before the model decides
PENALTY = math.log(2.0)


def _told(space: Space, trials: list[dict]) -> tuple[list[list[float]], list[float]]:
    ok = [math.log(t["step_s"]) for t in trials if t["status"] == "ok"]
    worst = max(ok) + PENALTY if ok else 0.0
    xs = [space.point(t["config"]) for t in trials]
    ys = [math.log(t["step_s"]) if t["status"] == "ok" else worst for t in trials]
    return xs, ys


def next_config(space: Space, trials: list[dict], budget: int, seed: int = 0,
                proposed: list[dict[str, str]] = ()) -> dict[str, str]:
    """The next search config, given the search trials so far (journal records) and the
    configs proposed to come right after the defaults."""
    for config in [space.defaults(), *proposed]:
        if not any(t["config"] == config for t in trials):
            return config
    from skopt import Optimizer

    opt = Optimizer(space.dimensions(), base_estimator="GP", acq_func="EI",
                    n_initial_points=min(INITIAL_POINTS, budget), initial_point_generator="lhs",
                    random_state=seed)
    xs, ys = _told(space, trials)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # skopt warns when it proposes a point twice
        opt.tell(xs, ys)
        return space.config(opt.ask())


def _best_configs(trials: list[dict]) -> list[dict]:
    """Distinct configs of successful trials, fastest (median step) first."""
    best: dict[str, dict] = {}
    for t in sorted((t for t in trials if t["status"] == "ok"), key=lambda t: t["step_s"]):
        best.setdefault(_key(t["config"]), t["config"])
    return list(best.values())


def _key(config: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(config.items()))


def finalists(space: Space, search: list[dict], count: int) -> list[dict[str, str]]:
    """The `count` configs to re-measure: the fastest, with the defaults always among them."""
    ranked = _best_configs(search)
    if count <= 0:
        return []
    chosen = ranked[:count]
    defaults = space.defaults()
    if defaults in ranked and defaults not in chosen:
        chosen = chosen[:count - 1] + [defaults]
    return chosen


def winner(search: list[dict], rechecks: list[dict], chosen: list[dict]) -> dict | None:
    """The config to commit: fastest re-measured finalist; without any, the fastest found."""
    measured = [t for t in rechecks if t["status"] == "ok" and t["config"] in chosen]
    if measured:
        return min(measured, key=lambda t: t["step_s"])["config"]
    ranked = _best_configs(search)
    return ranked[0] if ranked else None


def measurements(config: dict[str, str], trials: list[dict]) -> list[float]:
    """Every successful median step time of this config, in journal order."""
    return [t["step_s"] for t in trials if t["status"] == "ok" and t["config"] == config]
