"""A DDP script around an embedding table, for the row-sparse all-reduce's equivalence tests.

Each rank draws its own tokens (`--tokens` per step from `--vocab` rows), so the table's
gradient is nonzero in different rows on each rank. Rank 0 saves the final model and
optimizer state, the model's gradient bytes and the table's to --out.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self, vocab: int, dim: int, tie: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.out.weight = self.embed.weight  # a tied output layer: the table's gradient is dense

    def forward(self, tokens):
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(Net(args.vocab, args.dim, args.tie))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    data = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(args.steps):
        for micro in range(args.accumulate):
            tokens = torch.randint(0, args.vocab, (args.tokens,), generator=data)
            sync = micro == args.accumulate - 1
            with (model.no_sync() if not sync else torch.enable_grad()):
                loss = nn.functional.cross_entropy(model(tokens), tokens.roll(1))
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    if dist.get_rank() == 0:
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        table = model.module.embed.weight
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "grad_bytes": grad_bytes, "table_bytes": table.numel() * table.element_size()}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
