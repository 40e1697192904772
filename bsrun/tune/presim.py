"""--presim: one profile of the job, and its what-if replay proposes the search's first points.

The profile is `bsrun profile` of the same launch, started as a trial is (bsrun.child, so
it ends with the tuner), with the config the job would run with. The what-if model (bsrun/profile/
whatif.py) then predicts the step time of every point of the space's grid, and the
fastest predicted ones (other than the defaults, which are measured first anyway; one per
partition size, so they are not near-duplicates) take the place of the Latin hypercube
among the first points. The prediction only proposes: every
point is still measured by a real trial, and the Gaussian process learns from those.
"""

from __future__ import annotations

from bsrun import child
from bsrun.config import resolve
from bsrun.tune.space import Space
from bsrun.tune.trial import TrialSetup

PROFILE_STEPS = 4


def _bytes(space: Space, config: dict[str, str]) -> tuple[int, int]:
    """Partition and credit bytes of a candidate, resolved as a trial's launch resolves them."""
    resolved = resolve({**space.fixed, **config}, env={})
    return resolved.partition, resolved.credit_bytes


def propose(setup: TrialSetup, space: Space, count: int) -> dict:
    """A journal record: the proposed configs with their predictions, or why there are none."""
    folder = setup.log_dir / "presim-profile"
    setup.log_dir.mkdir(parents=True, exist_ok=True)
    args = setup.job_args(["profile", "-o", str(folder), "--warmup", str(setup.warmup),
                           "--steps", str(PROFILE_STEPS)])
    log = setup.log_dir / "presim-profile.log"
    record = {"type": "presim", "profile": str(folder), "log": str(log), "configs": [], "predicted_s": []}
    with open(log, "w") as out:
        code = child.run(args, setup.timeout_s, setup.stop_grace_s, log=out).code
    if code is None:
        return {**record, "reason": f"the profile did not finish within {setup.timeout_s:g} s and was stopped"}
    if code != 0:
        return {**record, "reason": f"the profile exited with code {code} (see {log})"}
    from bsrun.profile import trace, whatif

    try:
        model = whatif.fit(trace.load(folder))
    except (OSError, ValueError) as e:
        return {**record, "reason": f"the profile cannot be replayed: {e}"}
    defaults = space.defaults()
    predicted = sorted(((whatif.predict(model, *_bytes(space, c), True), c) for c in space.grid() if c != defaults),
                       key=lambda pc: pc[0])
    best, partitions = [], set()
    for t, c in predicted:  # one per partition size: near-duplicates would teach the model little
        if c.get("partition") not in partitions or "partition" not in c:
            best.append((t, c))
            partitions.add(c.get("partition"))
        if len(best) == count:
            break
    return {**record, "configs": [c for _, c in best], "predicted_s": [round(t, 4) for t, _ in best],
            "measured_step_s": model.profiled.get("measured_step_s")}
