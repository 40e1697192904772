"""What workers and parameter servers agree on: the group, the messages, the assignment.

One gloo process group of its own spans the N workers (ranks 0..N-1, their ranks in the
job) and the K servers (ranks N..N+K-1); its store is a TCPStore held by server 0. The
script's own process group is untouched.

A push of partition `pid` of model `m` in its layout `g` is two messages from the worker
to the server that holds the partition: a header (int64 [m, pid, g]) on HEADER_TAG, then
the gradient bytes on `data_tag(m, pid)`. The pull is the server's reply on the same tag:
the sum over all workers, sent to each as soon as the last push arrived. Messages between
two ranks on one tag arrive in the order they were sent, so rounds need no number.

Layout g of model `m` (each partition's element count, dtype and server) is written to the
store by worker 0 before its first push, under `layout_key(m, g)`. A model is laid out
anew when adaptation switches its point (g = 0, 1, ...); every worker first finishes the
round, so no push of the old layout is left when the first of the new one is sent, and
the tags can be the same.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from bsrun.config import PS_ADDR_ENV, PS_PORT_ENV, PS_SERVERS_ENV, PS_WORKERS_ENV

HEADER_TAG = 0
MAX_PARTITIONS = 2**20  # per model: data tags are 1 + m * MAX_PARTITIONS + pid
STORE_PREFIX = "bsrun-ps"


def data_tag(model: int, pid: int) -> int:
    if pid >= MAX_PARTITIONS:
        raise ValueError(f"parameter-server mode takes at most {MAX_PARTITIONS} partitions per "
                         f"model; use a larger --partition")
    return 1 + model * MAX_PARTITIONS + pid


def layout_key(model: int, generation: int) -> str:
    return f"layout/{model}/{generation}"


def assign_servers(sizes: list[int], servers: int) -> list[int]:
    """Balanced by bytes: largest partition first, each to the least loaded server
    (lowest index on a tie), so the assignment is the same on every rank."""
    load = [0] * servers
    owner = [0] * len(sizes)
    for pid in sorted(range(len(sizes)), key=lambda p: (-sizes[p], p)):
        s = min(range(servers), key=lambda k: (load[k], k))
        owner[pid] = s
        load[s] += sizes[pid]
    return owner


def encode_layout(numels: list[int], dtypes: list[str], owners: list[int]) -> str:
    return json.dumps({"numel": numels, "dtype": dtypes, "server": owners})


def decode_layout(text: bytes | str) -> dict:
    layout = json.loads(text)
    layout["dtype"] = [getattr(torch, name.removeprefix("torch.")) for name in layout["dtype"]]
    return layout


class Group:
    """This process's place in the workers-and-servers group."""

    def __init__(self, rank: int, workers: int, servers: int, addr: str, port: int, timeout: timedelta):
        self.rank, self.workers, self.servers = rank, workers, servers
        size = workers + servers
        self.store = dist.TCPStore(addr, port, size, is_master=(rank == workers), timeout=timeout,
                                   wait_for_workers=False)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, self.store), rank, size, timeout)

    @classmethod
    def from_env(cls, rank: int, timeout: timedelta) -> "Group":
        env = os.environ
        missing = [v for v in (PS_ADDR_ENV, PS_PORT_ENV, PS_WORKERS_ENV, PS_SERVERS_ENV) if not env.get(v)]
        if missing:
            raise RuntimeError(f"--arch ps needs bsrun's launcher (`bsrun --arch ps -np N python ...`); "
                               f"{', '.join(missing)} not set")
        return cls(rank, int(env[PS_WORKERS_ENV]), int(env[PS_SERVERS_ENV]), env[PS_ADDR_ENV],
                   int(env[PS_PORT_ENV]), timeout)

    def server_rank(self, index: int) -> int:
        return self.workers + index
