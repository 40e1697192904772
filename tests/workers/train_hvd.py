"""A Horovod training script, as users write them, with the features the tests switch on.

Rank 0 saves the final model and optimizer state to --out, so a test can compare a
bsrun-scheduled run with a run under plain `horovodrun`.
"""

import argparse

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from train_equiv import Net  # the same small CNN as the DDP equivalence tests


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--passes", type=int, default=1, help="backward_passes_per_step")
    p.add_argument("--clip", type=float, default=None, help="synchronize(), clip, skip_synchronize()")
    p.add_argument("--predivide", type=float, default=1.0, help="gradient_predivide_factor")
    p.add_argument("--fp16", action="store_true", help="Horovod's fp16 compression")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(1234 + rank)  # different initial weights: broadcast_parameters must fix them
    model = Net(batchnorm=True)
    if a.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9, nesterov=True)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   backward_passes_per_step=a.passes,
                                   gradient_predivide_factor=a.predivide,
                                   compression=hvd.Compression.fp16 if a.fp16 else hvd.Compression.none)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    data = torch.Generator().manual_seed(99 + rank)

    for _ in range(a.steps):
        opt.zero_grad()
        for _ in range(a.passes):
            x = torch.randn(8, 3, 16, 16, generator=data)
            y = torch.randint(0, 10, (8,), generator=data)
            F.cross_entropy(model(x), y).backward()
        if a.clip is not None:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    final = {"model": model.state_dict(), "opt": opt.state_dict()}
    if rank == 0:
        torch.save(final, a.out)


if __name__ == "__main__":
    main()
