"""DDP's surface as Lightning and accelerate touch it at run time; rank 0 saves the parameters
and what the attributes read.

    python hooks_surface.py OUT

Steps alternate between Lightning's manual optimisation (the sync flag flipped inside the
forward, then Lightning's own `prepare_for_backward`; `reducer._delay_all_reduce()` only
for a static graph, which plain DDP itself refuses in this emulation) and accelerate's `trigger_sync_in_backward`
(two forwards under no_sync, the second backward forced to synchronise through
`model.reducer.prepare_for_backward([])`).
"""

import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.overrides.distributed import prepare_for_backward
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 10)
        self.wrapper = None  # set to the DDP model: the forward flips its flag, as Lightning does

    def forward(self, x):
        out = self.fc2(F.relu(self.fc1(x)))
        if self.wrapper is not None:  # _DDPForwardRedirection.on_after_inner_forward
            self.wrapper[0].require_backward_grad_sync = False
        return out


def lightning_manual_step(model, opt, x, y, first):
    net = model.module
    net.wrapper = [model]
    loss = F.cross_entropy(model(x), y)
    net.wrapper = None
    model.require_backward_grad_sync = True  # on_after_outer_forward
    prepare_for_backward(model, loss)  # strategy.pre_backward, manual optimisation
    loss.backward()
    if first and getattr(model, "static_graph", False):  # DDPStrategy.post_backward
        model.reducer._delay_all_reduce()
    opt.step()
    opt.zero_grad()


def accelerate_trigger_sync_step(model, opt, xs, ys):
    with model.no_sync():
        loss_a = F.cross_entropy(model(xs[0]), ys[0])
        loss_b = F.cross_entropy(model(xs[1]), ys[1])
    loss_a.backward()  # accumulates locally
    old = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])
    try:
        loss_b.backward()  # synchronises both
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = old
    opt.step()
    opt.zero_grad()


def surface(model) -> dict:
    data = model._get_ddp_logging_data()
    return {"static_graph": model.static_graph, "find_unused_parameters": model.find_unused_parameters,
            "gradient_as_bucket_view": model.gradient_as_bucket_view,
            "delay_all": model._delay_all_reduce_all_params, "device_ids": model.device_ids,
            "sync": model.require_backward_grad_sync, "world_size": data["world_size"],
            "logged_static_graph": data.get("static_graph"), "can_set": data.get("can_set_static_graph"),
            "rebuilt": model.reducer._rebuild_buckets()}


def main():
    out = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(7)
    model = DDP(Net(), gradient_as_bucket_view=True)
    model._set_ddp_runtime_logging_sample_rate(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(100 + rank)
    before = surface(model)
    for step in range(6):
        xs = [torch.randn(8, 16, generator=data) for _ in range(2)]
        ys = [torch.randint(0, 10, (8,), generator=data) for _ in range(2)]
        if step % 2 == 0:
            lightning_manual_step(model, opt, xs[0], ys[0], first=step == 0)
        else:
            accelerate_trigger_sync_step(model, opt, xs, ys)
    model._check_reducer_finalized()
    static = DDP(nn.Linear(4, 4), static_graph=True)
    other = DDP(nn.Linear(4, 4))  # static_graph set afterwards, as DDP's own constructor does it
    other._set_static_graph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other._set_static_graph()
    result = {k: v.float() for k, v in model.module.state_dict().items()}
    result["surface"] = {"before": before, "after": surface(model), "other_static": other.static_graph,
                         "static": static.static_graph, "static_logged": static._get_ddp_logging_data()["static_graph"],
                         "warned_twice": any("no need to set it again" in str(w.message) for w in caught)}
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
