"""A DDP model with a comm hook, scheduled by bsrun or not; rank 0 saves the final parameters.

    python hooks_train.py CASE OUT [BUCKET_MB]

BUCKET_MB is DDP's bucket_cap_mb (plain DDP's buckets; bsrun's partitions are its own).
For PowerSGD cases the saved state also holds the hook state's iteration count.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    """tanh and a squared loss keep every gradient matrix of full rank (for PowerSGD at full rank)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 48)
        self.fc2 = nn.Linear(48, 48)
        self.drop = nn.Dropout(0.1)  # the script's random stream, drawn while hooks run
        self.fc3 = nn.Linear(48, 8)

    def forward(self, x):
        return self.fc3(self.drop(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))))


def my_hook(process_group, bucket):
    """A hook bsrun does not know: it could use any group from any thread."""
    return default.allreduce_hook(process_group, bucket)


def register(model, case):
    """The hook state, or None."""
    if case == "allreduce":
        model.register_comm_hook(None, default.allreduce_hook)
    elif case == "allreduce-group":
        model.register_comm_hook(dist.group.WORLD, default.allreduce_hook)
    elif case == "fp16":
        model.register_comm_hook(None, default.fp16_compress_hook)
    elif case == "accelerate-fp16":  # accelerate's own registration: keywords state= and hook=
        from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
        DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16).register_comm_hook(model)
    elif case == "fp16-wrapper":
        model.register_comm_hook(None, default.fp16_compress_wrapper(default.allreduce_hook))
    elif case == "builtin-fp16":
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    elif case in ("powersgd", "powersgd-seed", "powersgd-full"):
        # full: rank 48 (every matrix's full rank) makes PowerSGD exact up to rounding;
        # seed: another random start, the size of PowerSGD's own noise
        full = case == "powersgd-full"
        state = powersgd.PowerSGDState(None, matrix_approximation_rank=48 if full else 1, start_powerSGD_iter=3,
                                       min_compression_rate=1e-9 if full else 2, warm_start=not full,
                                       random_seed=1 if case == "powersgd-seed" else 0)
        model.register_comm_hook(state=state, hook=powersgd.powerSGD_hook)  # as Lightning and accelerate
        return state
    elif case == "other-group":
        model.register_comm_hook(dist.new_group([0, 1]), default.allreduce_hook)
    elif case == "unknown":
        model.register_comm_hook(None, my_hook)
    else:
        raise SystemExit(f"unknown case {case}")
    return None


def main():
    case, out = sys.argv[1], sys.argv[2]
    bucket_mb = float(sys.argv[3]) if len(sys.argv) > 3 else 25
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(7)
    model = DDP(Net(), bucket_cap_mb=bucket_mb)
    hook_state = register(model, case)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(100 + rank)
    torch.manual_seed(1000 + rank)  # dropout differs per rank, as in real training
    for _ in range(10):
        opt.zero_grad()
        x = torch.randn(64, 16, generator=data)
        y = torch.randn(64, 8, generator=data)
        F.mse_loss(model(x), y).backward()
        opt.step()
    result = {k: v.float() for k, v in model.module.state_dict().items()}
    result["random"] = torch.rand(4)  # the script's own random stream, untouched by the hook
    if hook_state is not None:
        result["iter"] = hook_state.iter
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
