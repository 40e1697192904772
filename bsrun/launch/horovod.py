"""Horovod's side of bsrun's own launch: its rendezvous server and its gloo variables.

What `horovodrun --gloo` does for the workers it starts, for the workers bsrun starts:
an HTTP rendezvous server in the launcher, a host assignment of every rank (one host,
or one emulated host per rank), and per rank the HOROVOD_* variables. With these a
Horovod script runs under `bsrun -np N python train.py` unchanged; DDP scripts ignore
them. Only when Horovod is installed; Horovod's runner never imports torch.
"""

from __future__ import annotations

import importlib.util


def horovod_installed() -> bool:
    return importlib.util.find_spec("horovod") is not None


class HorovodRendezvous:
    """A context manager: the server runs inside the with-block; `env_for(rank)`."""

    def __init__(self, hostnames: list[str], server_addr: str, iface: str):
        """`hostnames[r]`: the host rank r runs on; `server_addr`: this process's address
        as the workers see it; `iface`: the interface gloo uses inside each host."""
        self.hostnames = hostnames
        self.server_addr = server_addr
        self.iface = iface
        self.server = None
        self.port = None
        self.slots = []

    def __enter__(self) -> "HorovodRendezvous":
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.http.http_server import RendezvousServer

        counts = {h: self.hostnames.count(h) for h in self.hostnames}  # in order of first rank
        hosts = ",".join(f"{h}:{n}" for h, n in counts.items())
        self.slots = get_host_assignments(parse_hosts(hosts), len(self.hostnames))
        self.server = RendezvousServer(verbose=0)
        self.port = self.server.start()
        self.server.init(self.slots)
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.stop()

    def env_for(self, rank: int) -> dict[str, str]:
        slot = self.slots[rank]
        return {
            "HOROVOD_HOSTNAME": slot.hostname,
            "HOROVOD_RANK": str(slot.rank), "HOROVOD_SIZE": str(slot.size),
            "HOROVOD_LOCAL_RANK": str(slot.local_rank), "HOROVOD_LOCAL_SIZE": str(slot.local_size),
            "HOROVOD_CROSS_RANK": str(slot.cross_rank), "HOROVOD_CROSS_SIZE": str(slot.cross_size),
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": self.server_addr,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(self.port),
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": self.iface,
        }


def rendezvous_for(nproc: int, net) -> HorovodRendezvous:
    """All ranks on this machine, or rank r on emulated host r of `net`."""
    if net is None:
        return HorovodRendezvous(["localhost"] * nproc, "127.0.0.1", "lo")
    return HorovodRendezvous([h.netns for h in net.hosts], net.gateway_addr, net.env_for(0)["HOROVOD_GLOO_IFACE"])
