"""The bench bound's communication with an embedding table, on each rank: the table leaves
DDP's buckets and its gradient is averaged by its rows, equal to the dense average."""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from bsrun.bench.worker import Comm
from bsrun.sched.row_sparse import embedding_tables

dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(4096, 128), nn.Linear(128, 8))
params = list(model.parameters())
tokens = torch.randint(0, 4096, (64,), generator=torch.Generator().manual_seed(dist.get_rank()))
model(tokens).square().sum().backward()
dense = [p.grad.clone() for p in params]
for d in dense:
    dist.all_reduce(d)
    d.div_(dist.get_world_size())
tables = [(p, rows) for p, rows in zip(params, embedding_tables(params, list(model.modules()))) if rows]
comm = Comm(params, tables)
comm.step()
assert [rows for _, rows in tables] == [4096], tables
assert sum(b.numel() for b in comm.buckets) == sum(p.numel() for p in params[1:]), "the table left the buckets"
assert torch.equal(params[0].grad, dense[0]), "the table's rows average to the dense average"
print("ok", dist.get_rank(), file=sys.stderr)
dist.destroy_process_group()
