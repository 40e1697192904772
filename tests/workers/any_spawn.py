"""pytorch/examples' ImageNet pattern: `python any_spawn.py --out X` starts its 2 workers
itself with torch.multiprocessing.spawn; each joins a gloo group at its own
MASTER_ADDR/PORT, wraps the MLP in DDP, trains a few steps; rank 0 saves the state_dict.
With --sleep DIR each worker instead writes DIR/pid-<rank> after its first step and sleeps
(for the test that kills the launcher)."""

import argparse
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import any_common  # noqa: E402
from exact_common import end_process_group  # noqa: E402

WORLD = 2


def worker(rank: int, out: str | None, sleep_dir: str | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model = DDP(any_common.make_model())
    if sleep_dir:
        any_common.train(model, rank)
        Path(sleep_dir, f"pid-{rank}").write_text(str(os.getpid()))
        time.sleep(120)
    any_common.train(model, rank)
    if rank == 0:
        any_common.save(model.module, out)
    end_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--sleep", default=None)
    a = p.parse_args()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    mp.spawn(worker, args=(a.out, a.sleep), nprocs=WORLD)
