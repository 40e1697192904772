"""Measures this rank's clock offset to rank 0, for the profile recording's "clock" line.

Called at the same point on every rank (the first model seen: a collective). Each
protocol runs CLOCK_ROUNDS exchanges and keeps the one with the shortest round trip
(NTP's rule): its offset is the least disturbed by queueing.

- torch.distributed: ping-pongs with rank 0 over a gloo group of its own (the default
  group may be NCCL, and the script's collectives keep their own sequence);
- Horovod without torch.distributed: broadcasts and an allgather (Horovod has no
  point-to-point messages).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from bsrun.trace_events import now

CLOCK_ROUNDS = 8


def measure() -> dict:
    """{"offset_ns": this rank's clock minus rank 0's, "rtt_ns": its round trip, "method": how}."""
    hvd = sys.modules.get("horovod.torch")
    initialized = dist.is_available() and dist.is_initialized()
    if not initialized and hvd is not None and hvd.is_initialized() and hvd.size() > 1:
        return _horovod(hvd)
    if not initialized or dist.get_world_size() == 1:
        return _clock(0, 0, "single process" if dist.is_available() else "none")
    return _ping_pong()


def _clock(offset_ns: int, rtt_ns: int, method: str) -> dict:
    return {"offset_ns": offset_ns, "rtt_ns": rtt_ns, "method": method}


def _ping_pong() -> dict:
    """Each rank sends its time t0; rank 0 answers with its own; back at t3, the offset is
    (t0 + t3) / 2 - rank 0's time."""
    group = dist.new_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stamp = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        for peer in range(1, world):
            for _ in range(CLOCK_ROUNDS):
                dist.recv(stamp, src=peer, group=group)
                stamp[0] = now()
                dist.send(stamp, dst=peer, group=group)
        return _clock(0, 0, "reference")
    best = None
    for _ in range(CLOCK_ROUNDS):
        t0 = now()
        stamp[0] = t0
        dist.send(stamp, dst=0, group=group)
        dist.recv(stamp, src=0, group=group)
        t3 = now()
        if best is None or t3 - t0 < best[1]:
            best = ((t0 + t3) // 2 - int(stamp[0]), t3 - t0)
    return _clock(best[0], best[1], f"gloo ping-pong with rank 0, best of {CLOCK_ROUNDS}")


def _horovod(hvd) -> dict:
    """Rank 0 broadcasts when it sent (t0), every rank notes when it got it (t1), all
    gather when they sent (t2), rank 0 notes when it got them (t3) and broadcasts it:
    offset = ((t1 - t0) - (t3 - t2)) / 2."""
    rank, best = hvd.rank(), None
    for k in range(CLOCK_ROUNDS):
        t0 = int(hvd.broadcast(torch.tensor([now()]), root_rank=0, name=f"bsrun.clock.{k}.a")[0])
        t1 = now()
        t2s = hvd.allgather(torch.tensor([now()]), name=f"bsrun.clock.{k}.b")
        t3 = int(hvd.broadcast(torch.tensor([now()]), root_rank=0, name=f"bsrun.clock.{k}.c")[0])
        t2 = int(t2s[rank])
        rtt = (t1 - t0) + (t3 - t2)
        if rank != 0 and (best is None or rtt < best[1]):
            best = (((t1 - t0) - (t3 - t2)) // 2, rtt)
    offset, rtt = best or (0, 0)
    return _clock(offset, rtt, "reference" if rank == 0 else f"Horovod broadcasts with rank 0, best of {CLOCK_ROUNDS}")
