"""One benchmark run on one rank: an ordinary DDP training script, its parts and its bound.

    python -m bsrun.bench.worker --model vgg16 --mode ddp --steps 8 --warmup 3 --out r.json

Started by `bsrun -np N` (which sets the torchrun variables). Modes:

- ddp, bsrun: the same plain DDP loop; the launcher decides whether it is scheduled
  (`bsrun --no-schedule` leaves DDP as it is), so the script is the unmodified user's;
- horovod, bsrun-horovod: the same loop with `hvd.DistributedOptimizer` (Horovod's
  defaults) instead of DDP; again only the launcher differs;
- compute: the same model and loop without DDP and without any communication;
- comm: only communication: the gradients' sizes, bucketed as DDP buckets them
  (bsrun.sched.partition.ddp_buckets), all-reduced every step;
- bound: each step runs compute's step alone, then a barrier, then comm's step alone, and
  times the two parts; the step's bound is max(compute_i, comm_i), where compute_i is the
  slowest rank's compute and comm_i the shortest of the ranks' comm times (the rank that
  left the barrier last waited for no other). Any schedule that does the same work with
  dependencies (DDP, bsrun) has to run all of that compute on every rank and complete
  all of those all-reduces within its step, and each takes at least its time alone, so
  its step cannot be shorter than the larger of the two: the bound is perfect overlap
  with nothing in each other's way. It does not charge the CPU that communication takes
  from computation when they do run at once (on few cores a real cost), nor DDP's own
  hook and copy work: both only make real modes slower, so the bound stays a bound.
  Its comm sends an embedding table's gradient by its nonzero rows, as bsrun does
  (bsrun/sched/row_sparse.py; the real gradient of the step just computed): DDP sends
  more, so it stays a bound for DDP, and it is one for bsrun's less work too;
- overlap: compute and comm at once in two threads with no dependency between them, each
  step ending when both are done: not a bound (the two threads contend for the CPU, and on
  a 2-core machine it can come out slower than ddp); overlap minus bound shows what that
  contention costs. The bench's `bound` before this split was this measurement.

Each step's time is the time between consecutive step ends on rank 0 after a barrier;
no barrier inside the timed steps (one would add a synchronisation plain training does
not have). With scheduling a step can end while its communication is still in flight;
the next step's forward waits for it, so consecutive step ends still count all the work.
The bound is the exception: its step time is max(compute_i, comm_i), not a wall time, so
the barrier between its parts costs it nothing.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from bsrun.bench import models
from bsrun.bench.launches import MODES
from bsrun.fsutil import atomic_write_json
from bsrun.sched.partition import ddp_buckets
from bsrun.sched.row_sparse import RowSparseAllReduce, embedding_tables

LR = 1e-3


def bucket_buffers(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """One flat gradient-sized buffer per DDP bucket, in the order DDP sends them (DDP
    fills its buckets in reverse parameter order)."""
    ready = list(reversed(params))
    buckets = ddp_buckets([p.numel() * p.element_size() for p in ready])
    return [torch.zeros(sum(ready[i].numel() for i in bucket), dtype=params[0].dtype) for bucket in buckets]


class Comm:
    """All-reduce every bucket asynchronously, as DDP's reducer issues them, then wait.
    `tables`: (parameter, rows) of embedding tables whose gradients (left by a compute step)
    go by their nonzero rows, as bsrun sends them, instead of in the buckets."""

    def __init__(self, params: list[torch.Tensor], tables: list[tuple[torch.Tensor, int]] = ()):
        self.tables = list(tables)
        self.buckets = bucket_buffers([p for p in params if all(p is not t for t, _ in self.tables)])
        self.world = dist.get_world_size()

    def step(self) -> None:
        works = []
        for buf in self.buckets:
            buf.div_(self.world)  # DDP's default hook averages before the all-reduce
            works.append(dist.all_reduce(buf, async_op=True))
        sparse = [RowSparseAllReduce(t.grad.view(rows, -1), None, self.world) for t, rows in self.tables]
        for w in works:
            w.wait()
        for table in sparse:
            table.finish()


class Compute:
    """forward + backward + SGD step of the model (communication only where `model` is
    DDP, or `horovod` wraps the optimizer)."""

    def __init__(self, name: str, model: torch.nn.Module, batch, horovod: bool = False):
        self.name, self.model, (self.x, self.y) = name, model, batch
        self.opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        if horovod:
            import horovod.torch as hvd

            hvd.init()
            self.opt = hvd.DistributedOptimizer(self.opt, named_parameters=model.named_parameters())
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def step(self) -> None:
        self.opt.zero_grad()  # set_to_none, torch's default (Horovod's takes no argument)
        models.loss(self.name, self.model(self.x), self.y).backward()
        self.opt.step()


class Bound:
    """Compute alone, then communication alone, each step; the bound is the larger part."""

    def __init__(self, compute: Compute, comm: Comm):
        self.compute, self.comm = compute, comm
        self.compute_times: list[float] = []
        self.comm_times: list[float] = []

    def step(self) -> None:
        start = time.perf_counter()
        self.compute.step()
        computed = time.perf_counter()
        dist.barrier()  # every rank starts its all-reduces together: comm waits for no rank's compute
        started = time.perf_counter()
        self.comm.step()
        self.compute_times.append(computed - start)
        self.comm_times.append(time.perf_counter() - started)

    def result(self, steps: int) -> dict:
        """The last `steps` steps (every rank calls this): compute, the slowest rank's;
        comm, the shortest rank's; the step time, max of the two."""
        compute = torch.tensor(self.compute_times[-steps:], dtype=torch.float64)
        comm = torch.tensor(self.comm_times[-steps:], dtype=torch.float64)
        dist.all_reduce(compute, op=dist.ReduceOp.MAX)
        dist.all_reduce(comm, op=dist.ReduceOp.MIN)
        compute_times, comm_times = compute.tolist(), comm.tolist()
        return {"step_times": [max(c, m) for c, m in zip(compute_times, comm_times)],
                "compute_times": compute_times, "comm_times": comm_times}


class Overlap:
    """Compute on this thread and communication on another, both independent."""

    def __init__(self, compute: Compute, comm: Comm):
        self.compute, self.comm = compute, comm
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-comm")

    def step(self) -> None:
        pending = self.pool.submit(self.comm.step)
        self.compute.step()
        pending.result()


def make_stepper(name: str, mode: str, model: torch.nn.Module, batch):
    params = [p for p in model.parameters() if p.requires_grad]
    if mode in ("ddp", "bsrun"):
        # Looked up at call time: under scheduling bsrun has replaced this class.
        return Compute(name, torch.nn.parallel.DistributedDataParallel(model), batch)
    if mode in ("horovod", "bsrun-horovod"):
        return Compute(name, model, batch, horovod=True)
    if mode == "compute":
        return Compute(name, model, batch)
    if mode == "comm":
        return Comm(params)
    if mode == "bound":
        tables = [(p, rows) for p, rows in zip(params, embedding_tables(params, list(model.modules()))) if rows]
        return Bound(Compute(name, model, batch), Comm(params, tables))
    return Overlap(Compute(name, model, batch), Comm(params))


def timed_steps(stepper, steps: int, warmup: int) -> tuple[list[float], dict]:
    """Step times, and what the timed steps cost this process: CPU seconds (all its
    threads) and context switches, a step. On a machine whose cores are all busy, a mode
    that needs more CPU a step is slower for it (BENCHMARKS.md, twelfth pass)."""
    for _ in range(warmup):
        stepper.step()
    dist.barrier()  # all ranks start timing together
    cpu, switches = time.process_time(), _context_switches()
    times, last = [], time.perf_counter()
    for _ in range(steps):
        stepper.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    costs = {"cpu_s_per_step": (time.process_time() - cpu) / steps,
             "context_switches_per_step": (_context_switches() - switches) / steps}
    return times, costs


def _context_switches() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def measure(stepper, steps: int, warmup: int) -> dict:
    """{"step_times": [...], "cpu_s_per_step": ..., ...}, rank 0's; the bound's parts with them."""
    times, costs = timed_steps(stepper, steps, warmup)
    return {**(stepper.result(steps) if isinstance(stepper, Bound) else {"step_times": times}), **costs}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bsrun.bench.worker", description=__doc__.split("\n")[0])
    p.add_argument("--list-models", action="store_true", help="print the model names and exit")
    p.add_argument("--model")
    p.add_argument("--mode", choices=MODES)
    p.add_argument("--batch", type=int, default=None, help="per-rank batch (default: the model's)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args(argv)
    if not a.list_models:
        missing = [f"--{k}" for k in ("model", "mode", "out") if getattr(a, k) is None]
        if missing:
            p.error(f"{', '.join(missing)} required")
        if a.model not in models.MODELS:
            p.error(f"unknown model {a.model!r}; choose from {', '.join(models.MODELS)}")
        if a.steps < 1 or a.warmup < 0 or (a.batch is not None and a.batch < 1):
            p.error("--steps and --batch must be at least 1, --warmup at least 0")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.list_models:
        print(" ".join(models.MODELS))
        return 0
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial model everywhere, as after DDP's broadcast
    model = models.build(a.model)
    batch = a.batch or models.default_batch(a.model)
    data = models.make_batch(a.model, batch, torch.Generator().manual_seed(1 + rank))
    stepper = make_stepper(a.model, a.mode, model, data)
    measured = measure(stepper, a.steps, a.warmup)
    if rank == 0:
        atomic_write_json(a.out, {
            "model": a.model, "mode": a.mode, "batch": batch, "world_size": dist.get_world_size(), "warmup": a.warmup,
            **measured, "params": models.param_count(model), "grad_bytes": models.grad_bytes(model)})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
