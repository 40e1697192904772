"""DDP's join() for a scheduled model: uneven inputs, where a rank that ran out shadows the others.

torch.distributed.algorithms.Join runs, on a rank whose inputs are exhausted, the hook's
`main_hook` once per iteration the other ranks still train, and `post_hook` when every
rank has joined. DDP's own hook (_DDPJoinHook) shadows its forward and backward
collectives; this one shadows bsrun's, in the order the other ranks issue them on the
model's control group:

  forward: the buffer broadcast (from the highest rank not joined, as DDP picks it under
  Join: a MAX all-reduce of the candidates' ranks, then the broadcast), then the
  announcement (a sum over the ranks: each rank that has not joined says whether its
  forward will be followed by a synchronising backward, and that it is there);
  backward: one bsrun round with zeros for every gradient (`ModelRuntime.shadow_round`:
  the agreed partitions in the agreed order, negotiated or replayed as the others' round), and with
  find_unused_parameters=True the used map;
  step: in the first synchronising round with a rank joined, online adaptation's last
  agreements (`Adapter.at_join`): the others learn of the join from the announcement's
  count, the joined rank from its first shadowed round, so every rank keeps the same point
  from the same round on;
  post_hook: the model (parameters, and the buffers when DDP would broadcast them) from
  the highest rank among the last to join, as DDP's _sync_final_model.

Join's own notification (`Join.notify_join_context` each forward, on
`join_process_group`, the script's group as for DDP) is Join's business. Averaging
divides by the initial world size, as DDP's default: joined ranks add zeros.
`divide_by_initial_world_size=False` divides by the ranks not joined; bsrun's rounds
always divide by the world size, so that model becomes the real DDP if no round of
bsrun's has run yet and is refused otherwise. The replica check is off from a Join on:
the ranks step different numbers of times.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from bsrun.inject import state


def common_rank(group, candidate: bool) -> int:
    """The highest group rank among the candidates (DDP's _find_common_rank)."""
    rank = torch.tensor([dist.get_rank(group) if candidate else -1], dtype=torch.int64)
    dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=group)
    if rank.item() < 0:
        raise RuntimeError("bsrun: no rank is a candidate to broadcast the model from under Join")
    return int(rank.item())


class Announcement:
    """A rank that has not joined, each forward: [will its backward synchronise, 1], summed
    over the ranks asynchronously; a joined rank adds zeros (`others_sync`)."""

    def __init__(self, group, sync: bool):
        self.sums = torch.tensor([int(sync), 1], dtype=torch.int64)
        self.work = dist.all_reduce(self.sums, group=group, async_op=True)

    def ranks_training(self) -> int:
        self.work.wait()
        return int(self.sums[1])


def others_sync(group) -> bool:
    """A joined rank: does any other rank's backward synchronise in this iteration."""
    sums = torch.zeros(2, dtype=torch.int64)
    dist.all_reduce(sums, group=group)
    return sums[0].item() != 0


class ScheduledJoinHook(JoinHook):
    """What a joined rank of a scheduled DDP model does while others train (see the module)."""

    def __init__(self, model):
        self.model = model
        runtime = model._bsrun
        group = model._bsrun_transport.control_group
        runtime.adapter.watch_join(lambda: model._bsrun_announced is not None
                                   and model._bsrun_announced.ranks_training() < dist.get_world_size(group))
        if runtime.replicas.every:
            state.say_once("the replica check (--check-every) is off for a model trained under Join: "
                           "its ranks step different numbers of times")
            runtime.replicas.every = 0

    def main_hook(self) -> None:
        model = self.model
        group = model._bsrun_transport.control_group
        if model.require_forward_param_sync and model.forward_sync_buffers and model.modules_buffers:
            model._broadcast_buffers(common_rank(group, False))
        sync = others_sync(group)
        model.require_forward_param_sync = sync
        if not sync:
            return
        model._bsrun.shadow_round()
        if model._bsrun.unused is not None:
            model._bsrun.unused.shadow()
        adapter = model._bsrun.adapter
        adapter.at_join(adapter.last_step + 1)  # the others' step number for this round

    def post_hook(self, is_last_joiner: bool) -> None:
        model = self.model
        model._bsrun.flush()
        model._broadcast_model(common_rank(model._bsrun_transport.control_group, is_last_joiner))
