"""A DDP training script with the features the equivalence tests switch on one by one.

Rank 0 saves the final model and optimizer state to --out, so a test can compare a
scheduled run with a plain-DDP run of the same script.
"""

import argparse
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self, batchnorm: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8) if batchnorm else nn.Identity()
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def make_optimizer(name, model):
    net = model.module
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    if name == "adamw-groups":
        decay = [p for n, p in net.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in net.named_parameters() if not n.endswith("weight")]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-3)
    if name == "rmsprop":
        return torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.5)
    if name == "adagrad":
        return torch.optim.Adagrad(model.parameters(), lr=0.01)
    if name == "lbfgs":
        return torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    raise SystemExit(f"unknown optimizer {name}")


def delay_collectives(rng, most):
    """Sleep randomly in bsrun's comm thread before each collective (this rank only)."""
    from bsrun.sched.torch_backend import TorchDistBackend

    post, negotiate = TorchDistBackend.post, TorchDistBackend.negotiate

    def slow_post(self, *args):
        time.sleep(rng.random() * most)
        return post(self, *args)

    def slow_negotiate(self, *args):
        time.sleep(rng.random() * most)
        return negotiate(self, *args)

    TorchDistBackend.post, TorchDistBackend.negotiate = slow_post, slow_negotiate


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--batchnorm", action="store_true")
    p.add_argument("--frozen", action="store_true", help="freeze conv1")
    p.add_argument("--scheduler", action="store_true", help="StepLR every 5 steps")
    p.add_argument("--clip", type=float, default=None)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--checkpoint-at", type=int, default=-1)
    p.add_argument("--accumulate", type=int, default=1, help="micro-steps per step, no_sync between")
    p.add_argument("--jitter", type=float, default=0.0, help="max random sleep (s) inside backward")
    p.add_argument("--comm-jitter", type=float, default=0.0,
                   help="max random sleep (s) before each collective of bsrun's comm thread")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)  # different initial weights: the initial broadcast must fix them
    net = Net(a.batchnorm)
    if a.frozen:
        for q in net.conv1.parameters():
            q.requires_grad_(False)
    if a.jitter:
        jitter_rng = random.Random(rank * 7919 + 1)
        for module in (net.conv1, net.fc1, net.fc2):
            module.register_full_backward_hook(lambda *_: time.sleep(jitter_rng.random() * a.jitter))
    if a.comm_jitter:
        delay_collectives(random.Random(rank * 104729 + 3), a.comm_jitter)
    model = DDP(net)
    opt = make_optimizer(a.optimizer, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5, gamma=0.5) if a.scheduler else None
    data = torch.Generator().manual_seed(99 + rank)

    for step in range(a.steps):
        opt.zero_grad()
        for micro in range(a.accumulate):
            x = torch.randn(8, 3, 16, 16, generator=data)
            y = torch.randint(0, 10, (8,), generator=data)
            last = micro == a.accumulate - 1
            ctx = model.no_sync() if not last else torch.enable_grad()
            with ctx:
                loss = F.cross_entropy(model(x), y) / a.accumulate
                loss.backward()
        if a.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        if a.optimizer == "lbfgs":
            def closure():
                opt.zero_grad()
                out = F.cross_entropy(model(x), y)
                out.backward()
                return out
            opt.step(closure)
        else:
            opt.step()
        if sched:
            sched.step()
        if a.eval_every and (step + 1) % a.eval_every == 0:
            model.eval()
            with torch.no_grad():
                model(torch.randn(4, 3, 16, 16, generator=data))
            model.train()
        if step == a.checkpoint_at:
            state = {"model": model.state_dict(), "opt": opt.state_dict()}
            if rank == 0:
                torch.save(state, a.out + ".ckpt")
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
    final = {"model": model.module.state_dict(), "opt": opt.state_dict()}
    if rank == 0:
        torch.save(final, a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
