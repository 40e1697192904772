"""A DDP loop in which rank 1 hangs or dies at step 3, after its backward pass, or in
which every rank stops in native code that holds the GIL (hold-gil).

    python hang_or_die.py hang|die|hold-gil [--find-unused]

--find-unused builds DDP(find_unused_parameters=True, skip_all_reduce_unused_params=True),
which bsrun leaves to plain DDP (its own reducer).
"""

import ctypes
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    behaviour = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plain = "--find-unused" in sys.argv  # skip_all_reduce_unused_params: bsrun leaves it to plain DDP
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10)),
                find_unused_parameters=plain, skip_all_reduce_unused_params=plain)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(100):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 10, (8,))).backward()
        if behaviour == "hold-gil" and step == 3:
            print(f"rank {rank} sleeps in libc holding the GIL", flush=True)
            ctypes.PyDLL(None).sleep(600)  # PyDLL: the call keeps the GIL
        if rank == 1 and step == 3:
            print("rank 1 stops here", flush=True)
            if behaviour == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
