"""Drives the scheduler core directly over real gloo, with per-rank random timing.

Each rank marks partitions ready in its own random order with random sleeps (and the
comm thread sleeps randomly before each post); rank 0 checks that both ranks issued the
same collectives in the same order and that every partition holds the right average.
"""
import json
import random
import sys
import threading
import time

import torch
import torch.distributed as dist

from bsrun.sched.core import Scheduler
from bsrun.sched.partition import TensorInfo, plan_partitions
from bsrun.sched.torch_backend import TorchDistBackend

rounds, jitter, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
rng = random.Random(rank * 1000 + 7)
shape_rng = random.Random(42)  # the same tensors on every rank
tensors = [torch.zeros(shape_rng.randint(1, 3000)) for _ in range(12)]
infos = [TensorInfo(t.numel(), 4, "torch.float32") for t in tensors]
parts = plan_partitions(infos, list(range(len(tensors)))[::-1], partition_bytes=2048)
backend = TorchDistBackend(dist.new_group(backend="gloo"), dist.new_group(backend="gloo"), parts,
                           lambda i: tensors[i],
                           {"torch.float32": torch.float32})
post = backend.post


def jittered_post(pid):
    time.sleep(rng.random() * jitter)
    return post(pid)


backend.post = jittered_post
order, errors, done = [], [], threading.Semaphore(0)


def on_complete(pid):
    order.append(pid)
    done.release()


sched = Scheduler(backend, [p.nbytes for p in parts], credit_bytes=3 * 2048,
                  on_complete=on_complete, on_error=errors.append)
tensors_of = [sorted({pc.tensor for pc in p.pieces}) for p in parts]
for r in range(rounds):
    for t in tensors:
        t.fill_(float(rank + 1 + r))
    for pid in rng.sample(range(len(parts)), len(parts)):
        time.sleep(rng.random() * jitter)
        sched.mark_ready(pid)
    for _ in parts:
        if not done.acquire(timeout=60):
            raise SystemExit(f"rank {rank}: round {r} hung; errors {errors}")
    expected = sum(q + 1 + r for q in range(world)) / world
    bad = [i for i, t in enumerate(tensors) if not torch.allclose(t, torch.full_like(t, expected))]
    if bad:
        raise SystemExit(f"rank {rank}: round {r}: tensors {bad} hold wrong averages")
sched.close()
orders = [None] * world
dist.all_gather_object(orders, order)
if rank == 0:
    json.dump({"orders": orders, "stats": sched.stats, "partitions": len(parts)}, open(out, "w"))
dist.destroy_process_group()
