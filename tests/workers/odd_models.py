"""Scripts that bsrun cannot schedule as usual, one per case; rank 0 saves the final state.

    python odd_models.py CASE OUT
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP


class Sparse(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.emb(x[:, 0].long().abs() % 50))


class MixedDtypes(nn.Module):
    """A bfloat16 layer between float32 ones: gradients of two dtypes."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32).to(torch.bfloat16)
        self.fc3 = nn.Linear(32, 10)

    def forward(self, x):
        h = F.relu(self.fc1(x)).to(torch.bfloat16)
        return self.fc3(F.relu(self.fc2(h)).float())


class Tied(nn.Module):
    """One weight shared by two layers (as language models tie embedding and output)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16, bias=False)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16, bias=False)
        self.out.weight = self.inp.weight
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.out(F.relu(self.mid(self.inp(x)))))


class Twice(nn.Module):
    """One layer applied twice in the same forward."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        return self.head(F.relu(self.block(F.relu(self.block(h)))))


class Branchy(nn.Module):
    """Half the batches skip a layer: DDP needs find_unused_parameters=True."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.extra = nn.Linear(16, 16)
        self.head = nn.Linear(16, 10)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = F.relu(self.fc1(x))
        if self.calls % 2:
            h = F.relu(self.extra(h))
        return self.head(h)


def build(case):
    torch.manual_seed(7)
    if case == "sparse":
        return DDP(Sparse())
    if case == "mixed-dtypes":
        return DDP(MixedDtypes())
    if case == "shared":
        return DDP(Tied())
    if case == "twice":
        return DDP(Twice())
    if case == "find-unused":
        return DDP(Branchy(), find_unused_parameters=True)
    if case == "comm-hook":
        model = DDP(Twice())
        model.register_comm_hook(None, fp16_compress_hook)
        return model
    if case == "comm-hook-other-group":  # a hook bsrun cannot move onto its own group
        model = DDP(Twice())
        model.register_comm_hook(dist.new_group([0, 1]), allreduce_hook)
        return model
    if case == "no-ddp":
        return Twice()
    raise SystemExit(f"unknown case {case}")


def average_gradients(model):
    """What a script that never builds DDP does by hand."""
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def main():
    case, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(case)
    dense = [p for n, p in model.named_parameters() if "emb" not in n]
    opts = [torch.optim.SGD(dense, lr=0.05, momentum=0.9)]
    if case == "sparse":
        opts.append(torch.optim.SGD([p for n, p in model.named_parameters() if "emb" in n], lr=0.05))
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(10):
        for opt in opts:
            opt.zero_grad()
        x = torch.randn(8, 16, generator=data)
        y = torch.randint(0, 10, (8,), generator=data)
        F.cross_entropy(model(x).float(), y).backward()
        if case == "no-ddp":
            average_gradients(model)
        for opt in opts:
            opt.step()
    net = model.module if isinstance(model, DDP) else model
    if rank == 0:
        torch.save({k: v.float() for k, v in net.state_dict().items()}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
