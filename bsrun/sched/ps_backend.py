"""CommBackend for parameter servers: each partition one push and one pull, one task.

Posting a partition pushes it to its server (bsrun/sched/ps_protocol.py) and posts the
receive of the sum into the same bytes; the task is done when the sum is in. The server
replies only after every worker's push arrived, so this worker's bytes were read before
the reply can overwrite them. Negotiation, averaging and unpacking are the all-reduce
backend's: the workers still agree on one issue order, which keeps a credit window from
deadlocking (with independent orders, worker A could hold its window full of partitions
worker B has not pushed, and B the reverse).

gloo's point-to-point work cannot be polled (it completes only in wait()), so results are
taken in the order posted (`in_order`); a sum that arrives early waits in its buffer.

`PSTransport`: the ranks agree and negotiate as for all-reduce; the bytes go to the
servers. Each model of the process is a numbered model on the servers, and each of its
layouts (a new one at every adaptation switch) a numbered generation of it.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import torch
import torch.distributed as dist

from bsrun.sched.ps_protocol import HEADER_TAG, Group, assign_servers, data_tag, encode_layout, layout_key
from bsrun.sched.torch_backend import TorchDistBackend, TorchTransport


class _PushPull:
    """The header send, the data send and the sum's receive of one partition."""

    def __init__(self, works, header: torch.Tensor):
        self.works = works
        self.header = header  # kept alive until its send is done

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class PSBackend(TorchDistBackend):
    in_order = True
    matched_by_order = False  # sends and receives per server: each round negotiated

    def __init__(self, group: Group, model: int, generation: int, negotiation_group, partitions, grad_of, dtypes):
        super().__init__(None, negotiation_group, partitions, grad_of, dtypes)
        self.group = group
        self.model, self.generation = model, generation
        self.world_size = group.workers
        self.owner = assign_servers([p.nbytes for p in partitions], group.servers)
        data_tag(model, len(partitions) - 1)  # too many partitions: fail now, with the reason
        if group.rank == 0:
            numels = [sum(pc.stop - pc.start for pc in p.pieces) for p in partitions]
            group.store.set(layout_key(model, generation),
                            encode_layout(numels, [p.dtype for p in partitions], self.owner))

    def server_of(self, pid: int) -> int:
        return self.group.server_rank(self.owner[pid])

    def post(self, pid: int):
        data = self.pack(pid)
        server, tag, pg = self.server_of(pid), data_tag(self.model, pid), self.group.pg
        header = torch.tensor([self.model, pid, self.generation], dtype=torch.int64)
        works = [pg.send([header], server, HEADER_TAG), pg.send([data], server, tag)]
        works.append(pg.recv([data], server, tag))
        return pid, data, _PushPull(works, header)


_GROUP: list[Group] = []  # this worker's place among workers and servers, made once
_MODEL_NUMBERS = itertools.count()  # the same sequence on every worker


class PSTransport(TorchTransport):
    row_sparse = False  # the servers sum whole partitions
    def __init__(self, ranks: list[int], timeout: timedelta):
        super().__init__(ranks, timeout)
        if not _GROUP:
            _GROUP.append(Group.from_env(dist.get_rank(), timeout))
        self.group = _GROUP[0]
        self.model = next(_MODEL_NUMBERS)
        self.generations = itertools.count()  # one per layout: every rank switches at the same step

    def backend(self, partitions, grad_of, dtypes) -> PSBackend:
        return PSBackend(self.group, self.model, next(self.generations), self.negotiation_group, partitions,
                         grad_of, dtypes)
