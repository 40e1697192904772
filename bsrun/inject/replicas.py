"""The replica check: every N optimizer steps the ranks compare checksums of their parameters.

Data-parallel replicas must stay equal; replicas that drift apart are a bug in someone's
code (a rank that updates differently, a non-deterministic kernel, a scheduler), and bsrun
must be the tool that notices, not the one that causes it. After step S (S a multiple of
`--check-every`), at the start of the next step() of the same optimizer, when every update
of step S has been applied to its parameters (the parameters of other optimizers may
still be pending, so only this optimizer's are compared), each rank takes one fingerprint
per parameter (the wrapping integer sum of its bit patterns: exact, independent of the
summation order, threads and vector width, and as fast as a float32 sum), rank 0's go to
every rank over the model's training-thread channel (one small broadcast), and a rank
whose fingerprints differ ends the job naming the first differing parameter and the step.

BSRUN_TEST_PERTURB=RANK:STEP (tests only) makes that rank add 1e-3 to its first checked
parameter right after step STEP, so a test can show that a divergence is caught.
"""

from __future__ import annotations

import torch

from bsrun.config import worker_setting
from bsrun.inject import state

PERTURB_ENV = "BSRUN_TEST_PERTURB"
PERTURBATION = 1e-3


def fingerprint(tensor: torch.Tensor) -> int:
    """The wrapping integer sum of the tensor's bit patterns: any change to one element changes it."""
    flat = tensor.detach().reshape(-1)
    size = flat.element_size()
    if size in (4, 8):
        bits = flat.view(torch.int32 if size == 4 else torch.int64)
    else:
        bits = flat.view(torch.int16 if size == 2 else torch.uint8).to(torch.int32)
    return int(bits.sum(dtype=bits.dtype))


def _perturbation() -> tuple[int, int] | None:
    text = worker_setting(PERTURB_ENV)
    if not text:
        return None
    rank, _, step = text.partition(":")
    return int(rank), int(step)


class ReplicaCheck:
    def __init__(self, every: int, names: list[str], agree):
        """`every`: steps between checks (0: never); `agree(int64 values)` returns rank 0's."""
        self.every = every
        self.names = names
        self.agree = agree
        self.checks = 0
        self.perturb = _perturbation()

    def before_step(self, number: int, indices: list[int], params: list[torch.Tensor]) -> None:
        """At step() number `number`, over the parameters `indices` that this optimizer steps
        (settled: their update of step `number - 1` applied)."""
        previous = number - 1
        if self.perturb is not None and self.perturb == (state.worker_rank(), previous) and indices:
            with torch.no_grad():
                params[indices[0]].add_(PERTURBATION)
        if not self.every or previous < 1 or previous % self.every or not indices:
            return
        mine = [fingerprint(params[i]) for i in indices]
        theirs = self.agree(mine)
        self.checks += 1
        if theirs != mine:
            first = next(k for k in range(len(mine)) if mine[k] != theirs[k])
            raise RuntimeError(state.failed(
                f"replicas differ after step {previous}: {self.names[indices[first]]} here is not "
                f"rank 0's (the replica check, --check-every {self.every}); the ranks' parameters "
                f"drifted apart"))
