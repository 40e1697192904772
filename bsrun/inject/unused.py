"""find_unused_parameters=True: which parameters some rank used, and what their gradients become.

The same for static_graph=True, whose reducer finds the unused parameters in its first
iteration and then treats them alike.

DDP's reducer (reducer.cpp: mark_variable_ready_dense, finalize_bucket_dense,
copy_bucket_to_grad) gives a parameter that got no gradient in a synchronising backward:

- its contribution to the all-reduce: its current `.grad` if defined (say, accumulated
  under no_sync), else zeros;
- a map of the parameters used on this rank since the last synchronising backward (the
  no_sync passes included), summed over the ranks;
- used on some rank: `.grad` becomes the average (created if it was None);
  used on no rank: `.grad` is left untouched (None stays None, so the optimizer skips
  it; a defined one keeps its own local value, not averaged).

bsrun does the same lazily. At the end of each synchronising backward the training
thread posts the used map's all-reduce on the model's control group (asynchronous) and
gives each locally unused parameter a contribution of its own (a clone, so a `.grad` that
must stay untouched is not averaged in place; zeros for None); a parameter used here
under no_sync whose `.grad` is defined is globally used, so it is averaged in place as
usual. The write-back (average into `.grad`, or nothing) happens when the parameter is
settled: a read of its `.grad` (the trap), the optimizer step, zero_grad, the next
forward, a flush; only then is the used map waited for. With every parameter used the
cost is a set insert per gradient and one tiny all-reduce per backward, never waited for
on the critical path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class UsedMap:
    """One round's used map: posted at once, waited for at the first write-back that needs it."""

    def __init__(self, counts: torch.Tensor, group):
        self.counts = counts
        self.work = dist.all_reduce(self.counts, group=group, async_op=True)
        self.result: list[int] | None = None

    def wait(self) -> None:
        if self.result is None:
            self.work.wait()
            self.result = self.counts.tolist()

    def used(self, i: int) -> bool:
        """Used on at least one rank in this round."""
        self.wait()
        return self.result[i] > 0


class UnusedParameters:
    """The find_unused_parameters state of one model (ModelRuntime.unused)."""

    def __init__(self, group, count: int):
        self.group = group
        self.count = count
        self.local: set[int] = set()   # used here since the last synchronising backward
        self.writeback: dict[int, tuple[torch.Tensor, UsedMap]] = {}
        self.last: UsedMap | None = None

    def note_used(self, i: int) -> None:
        self.local.add(i)

    def end_of_backward(self, missing: list[int], params) -> dict[int, torch.Tensor]:
        """Post this round's used map; return each locally unused parameter's contribution
        (`missing` are settled: no write-back of theirs is owed any more)."""
        if self.last is not None:
            self.last.wait()  # the previous round's, long finished: keep one in flight
        mine = torch.zeros(self.count, dtype=torch.int32)
        if self.local:
            mine[sorted(self.local)] = 1
        used = self.last = UsedMap(mine, self.group)
        contributions = {}
        for i in missing:
            grad = params[i].grad
            if grad is not None and i in self.local:
                contributions[i] = grad  # used here under no_sync: averaged in place, as DDP does
                continue
            own = (grad.detach().clone(memory_format=torch.contiguous_format) if grad is not None
                   else torch.zeros_like(params[i], memory_format=torch.contiguous_format))
            contributions[i] = own
            self.writeback[i] = (own, used)
        self.local = set()
        return contributions

    def write_back(self, params, indices) -> None:
        """The averaged gradient into `.grad` of those used on some rank (their communication
        is finished); those used on no rank keep their `.grad` as it is."""
        for i in indices:
            entry = self.writeback.pop(i, None)
            if entry is None:
                continue
            averaged, used = entry
            if used.used(i):
                param = params[i]
                if param.grad is None:
                    param.grad = averaged
                else:
                    param.grad.copy_(averaged)

    def shadow(self) -> None:
        """A joined rank's used map for a round of the others (Join). DDP's joined rank
        all-reduces its reducer's device-side map in place, which holds the sum of the last
        round it took part in: so what any rank used in that round stays used (its gradient
        an average, of zeros if nobody uses it now) for every round it shadows."""
        if self.last is None:
            counts = torch.zeros(self.count, dtype=torch.int32)
        else:
            self.last.wait()
            counts = self.last.counts.clone()
        self.last = UsedMap(counts, self.group)


def track_unused(runtime, group) -> None:
    """Give a ModelRuntime these semantics from its next backward on (static_graph set by
    `_set_static_graph()` after the model was built)."""
    runtime.unused = UnusedParameters(group, len(runtime.params))
    runtime.writeback = runtime.unused.writeback
