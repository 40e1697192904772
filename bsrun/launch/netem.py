"""A one-machine emulated cluster: one network namespace per host, joined by a
bridge, with tc token-bucket shaping on both directions of every host's link.

Why: bsrun's speedups only show when communication is the bottleneck, and
loopback is far too fast for that. Real namespaces and real qdiscs give the
workers real sockets with a real rate limit, so gloo / Horovod run unmodified.

Naming scheme (everything carries the owner's pid, so leftovers of a dead owner
can be found and removed by `cleanup_stale`):

    namespace           bsrun-<pid>-<i>
    bridge              bsrbr<pid>
    veth, bridge side   bsrv<pid>x<i>   (its peer is `eth0` inside namespace i)

Nothing else on the host is touched: no global sysctl, no existing interface.
Each network takes a /24 of 198.18.0.0/15 (the RFC 2544 benchmark range) that no address
in the root namespace uses yet, so two networks on one machine (two emulated launches at
once) never route into each other. Host i gets .(i+1) on its `eth0`; the bridge gets .254,
so that servers of the launcher (Horovod's rendezvous) are reachable from every host.

This kernel offers tbf but not netem (CONFIG_NET_SCH_NETEM is off here), so a
requested latency is only honoured where netem exists; otherwise it is a
NetemError saying so, never a silent no-op.
"""

from __future__ import annotations

import atexit
import os
import re
import threading
from dataclasses import dataclass, replace

from bsrun.launch import netns
from bsrun.launch.netns import NetemError, cleanup_stale

__all__ = [
    "NetemError",
    "EmulatedHost",
    "EmulatedNetwork",
    "parse_rate",
    "parse_latency",
    "cleanup_stale",
]

SUBNETS = 512  # the /24s of 198.18.0.0/15
PREFIX_LEN = 24
IFNAME = "eth0"
MAX_HOSTS = 253  # .1 .. .253 in one /24
GATEWAY_HOST = 254  # the bridge: the launcher's own address on the network
IFNAMSIZ = 15  # usable characters in a Linux interface name

# tbf: the bucket must hold at least one GSO super-packet (up to 64 KiB), or
# tbf splits / drops them and the achieved rate collapses. Beyond that, about
# 4 ms of traffic (rate / 250) keeps the long-run rate exact without letting
# large bursts through at line rate.
MIN_BURST_BYTES = 64 * 1024
BURST_FRACTION = 250
# How much may queue behind the bucket, in time at the shaped rate. Enough for
# TCP to keep the link busy; short enough that a small message queued behind
# bulk data is not delayed absurdly (this kernel has only FIFO qdiscs).
QUEUE_SECONDS = 0.025
MIN_LIMIT_BYTES = 256 * 1024

_UNITS_RATE = {"": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_UNITS_TIME = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER_UNIT_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$")


# ---------------------------------------------------------------- parsing


def _parse_quantity(text, units: dict[str, float], option: str, examples: str) -> float:
    """A number with one of `units`, or NetemError naming the option and the value."""
    if isinstance(text, int) and not isinstance(text, bool):
        text = str(text)
    match = _NUMBER_UNIT_RE.match(text.lower()) if isinstance(text, str) else None
    if not match or match.group(2) not in units:
        raise NetemError(f"{option} must be {examples}, got {text!r}")
    return float(match.group(1)) * units[match.group(2)]


def parse_rate(text: str | int, option: str = "--emulate-bandwidth") -> int:
    """Parse a tc-style rate ('3gbit', '500mbit', '100kbit', '2000000') to bit/s.

    Only the bit forms are accepted: tc reads 'bps' as *bytes* per second,
    which is a classic factor-8 mistake, so it is refused rather than guessed.
    """
    bits = _parse_quantity(text, _UNITS_RATE, option, "a rate such as 3gbit, 500mbit or 100kbit")
    if bits < 1:
        raise NetemError(f"{option} must be a positive rate such as 3gbit, got {text!r}")
    return int(round(bits))


def parse_latency(text: str, option: str = "--emulate-latency") -> float:
    """Parse a tc-style time ('100us', '2ms', '0.5ms', '1s') to seconds.

    A unit is required: tc reads a bare number as microseconds, which nobody
    expects, so a bare number is refused.
    """
    if isinstance(text, int):
        raise NetemError(f"{option} must be a time such as 100us, 2ms or 1s, got {text!r}")
    return _parse_quantity(text, _UNITS_TIME, option, "a time such as 100us, 2ms or 1s")


# ---------------------------------------------------------------- network


def free_subnet(owner_pid: int) -> str:
    """The first /24 of 198.18.0.0/15, from one the pid picks, that no address in the root
    namespace uses: "198.18.X." or "198.19.X."."""
    used = set(re.findall(r"inet (198\.1[89]\.\d+)\.\d+/", netns.run("ip", "-o", "-4", "addr", "show")))
    for k in range(SUBNETS):
        i = (owner_pid + k) % SUBNETS
        prefix = f"198.{18 + i // 256}.{i % 256}"
        if prefix not in used:
            return prefix + "."
    raise NetemError("every /24 of 198.18.0.0/15 is in use on this machine; no room for another emulated network")


@dataclass(frozen=True)
class EmulatedHost:
    """One emulated machine: a namespace with one interface and one address."""

    index: int
    netns: str
    addr: str
    ifname: str = IFNAME


# One live network per process: the names only carry the pid.
_ACTIVE_LOCK = threading.Lock()
_active_in_process: "EmulatedNetwork | None" = None


class EmulatedNetwork:
    """A bridge-connected set of namespaces with shaped links; a context manager.

        with EmulatedNetwork(hosts=2, rate_bps=parse_rate("1gbit")) as net:
            subprocess.run(net.wrap(0, [sys.executable, "train.py"]), env=...)

    Everything created is removed on exit, on `close()`, and at interpreter
    exit, whatever way the with-block ends.

    rate_bps shapes each host's link in both directions (None: unshaped).
    latency_s is one-way host-to-host delay, added on each host's egress;
    it needs netem, which this kernel may lack (then NetemError).
    """

    def __init__(self, hosts: int, rate_bps: int | None, latency_s: float | None = None):
        if not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
            raise NetemError(f"an emulated network needs 1 to {MAX_HOSTS} hosts, got {hosts!r}")
        if rate_bps is not None and (not isinstance(rate_bps, int) or rate_bps < 1):
            raise NetemError(f"the emulated rate must be a positive number of bit/s, got {rate_bps!r}")
        if latency_s is not None and latency_s < 0:
            raise NetemError(f"the emulated latency must not be negative, got {latency_s!r} s")
        self.rate_bps = rate_bps
        self.latency_s = latency_s or None  # 0 means no delay: no netem needed
        self.owner_pid = os.getpid()
        self.bridge = f"bsrbr{self.owner_pid}"
        self.subnet = ""  # "198.18.X.": open() picks one no other network uses
        self.hosts = [EmulatedHost(index=i, netns=f"bsrun-{self.owner_pid}-{i}", addr="") for i in range(hosts)]
        self._veths = [f"bsrv{self.owner_pid}x{i}" for i in range(hosts)]
        if any(len(name) > IFNAMSIZ for name in [self.bridge, *self._veths]):
            raise NetemError(
                f"process id {self.owner_pid} is too long for interface names; "
                f"at most {IFNAMSIZ} characters are allowed"
            )
        self._created: list[tuple[str, str]] = []  # (kind, name), in creation order
        self._open = False

    # -- lifecycle

    def __enter__(self) -> "EmulatedNetwork":
        self.open()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def open(self) -> None:
        """Build the network; on any failure (even Ctrl-C) undo what was built."""
        global _active_in_process
        netns.require_root()
        netns.require_tools()
        with _ACTIVE_LOCK:
            if _active_in_process is not None:
                raise NetemError(
                    "this process already has an emulated network up; close it before opening another"
                )
            _active_in_process = self
        self._open = True
        atexit.register(self.close)
        try:
            cleanup_stale()
            # Leftovers of this very pid (an earlier network here whose close failed).
            netns.remove_owned(lambda pid: pid == self.owner_pid)
            self.subnet = free_subnet(self.owner_pid)
            self.hosts = [replace(h, addr=f"{self.subnet}{h.index + 1}") for h in self.hosts]
            self._create_bridge()
            for host in self.hosts:
                self._create_host(host)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove everything this network created. Idempotent and re-entrant.

        Safe from signal handlers and atexit: every removal ignores 'already
        gone', and a final sweep by name catches anything created but not yet
        recorded when setup was interrupted.
        """
        global _active_in_process
        if not self._open or os.getpid() != self.owner_pid:
            return  # closed already, or a forked child that inherited atexit: not its network
        for kind, name in reversed(list(self._created)):
            if kind == "link":
                netns.try_run("ip", "link", "del", name)
            else:
                netns.try_run("ip", "netns", "del", name)
        try:
            netns.remove_owned(lambda pid: pid == self.owner_pid)
        except NetemError:
            pass
        self._created.clear()
        self._open = False
        if _active_in_process is self:
            _active_in_process = None
        atexit.unregister(self.close)

    # -- building blocks

    def _create_bridge(self) -> None:
        """The switch in the root namespace that every host's link plugs into."""
        netns.run("ip", "link", "add", self.bridge, "type", "bridge")
        self._created.append(("link", self.bridge))
        netns.run("ip", "addr", "add", f"{self.gateway_addr}/{PREFIX_LEN}", "dev", self.bridge)
        netns.run("ip", "link", "set", self.bridge, "up")

    def _create_host(self, host: EmulatedHost) -> None:
        """Namespace + veth (eth0 inside, bridge port outside) + address + shaping."""
        veth = self._veths[host.index]
        netns.run("ip", "netns", "add", host.netns)
        self._created.append(("netns", host.netns))
        netns.run("ip", "link", "add", veth, "type", "veth", "peer", "name", host.ifname, "netns", host.netns)
        self._created.append(("link", veth))
        netns.run("ip", "link", "set", veth, "master", self.bridge)
        netns.run("ip", "link", "set", veth, "up")
        ns = ("ip", "-n", host.netns)
        netns.run(*ns, "link", "set", "lo", "up")
        netns.run(*ns, "addr", "add", f"{host.addr}/{PREFIX_LEN}", "dev", host.ifname)
        netns.run(*ns, "link", "set", host.ifname, "up")
        if self.rate_bps is not None or self.latency_s is not None:
            self._shape(("tc", "-n", host.netns), host.ifname, self.latency_s)  # host -> switch
            self._shape(("tc",), veth, None)  # switch -> host

    def _shape(self, tc: tuple[str, ...], dev: str, delay_s: float | None) -> None:
        """Root qdisc(s) on one egress: tbf for the rate, netem above it for delay."""
        parent: tuple[str, ...] = ("root",)
        if delay_s is not None:
            self._add_netem(tc, dev, delay_s)
            parent = ("parent", "1:1")
        if self.rate_bps is not None:
            burst, limit = tbf_parameters(self.rate_bps)
            netns.run(*tc, "qdisc", "add", "dev", dev, *parent, "handle", "10:", "tbf",
                 "rate", f"{self.rate_bps}bit", "burst", str(burst), "limit", str(limit))

    def _add_netem(self, tc: tuple[str, ...], dev: str, delay_s: float) -> None:
        """netem delay as the root qdisc; explain if the kernel has no netem."""
        delay = f"{int(round(delay_s * 1e6))}us"
        try:
            netns.run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                 "delay", delay, "limit", "100000")
        except NetemError as err:
            if "unknown" in str(err).lower():
                raise NetemError(
                    "emulated latency needs the netem qdisc, which this kernel does not "
                    "have (CONFIG_NET_SCH_NETEM is off); leave the latency unset"
                ) from None
            raise

    # -- what launchers use

    @property
    def master_addr(self) -> str:
        """Rendezvous address: host 0."""
        return self.hosts[0].addr

    @property
    def gateway_addr(self) -> str:
        """The launcher's address as the hosts see it (the bridge's)."""
        return f"{self.subnet}{GATEWAY_HOST}"

    def wrap(self, index: int, argv: list[str]) -> list[str]:
        """The command line that runs argv inside host `index`'s namespace."""
        return ["ip", "netns", "exec", self.hosts[index].netns, *argv]

    def env_for(self, index: int) -> dict[str, str]:
        """Environment that makes gloo (torch and Horovod) use the emulated link.

        Without an interface name gloo resolves the hostname, which points at
        the real machine, not at this namespace.
        """
        host = self.hosts[index]
        return {
            "GLOO_SOCKET_IFNAME": host.ifname,
            "TP_SOCKET_IFNAME": host.ifname,
            "HOROVOD_GLOO_IFACE": host.ifname,
        }

    def measure_rate(self, seconds: float = 1.0, src: int = 1, dst: int = 0) -> float:
        """Achieved TCP throughput src -> dst in bit/s, from one short transfer.

        The receiver times from its first to its last byte, so connection set-up
        is excluded and data still queued when the sender stops is counted.
        """
        if not self._open:
            raise NetemError("the emulated network is not up; use it inside its with-block")
        if len(self.hosts) < 2:
            raise NetemError("measuring the rate needs at least 2 emulated hosts")
        from bsrun.launch.linkrate import measure_tcp

        return measure_tcp(self, src, dst, seconds)


def tbf_parameters(rate_bps: int) -> tuple[int, int]:
    """(burst, limit) in bytes for a tbf at rate_bps; see the constants above."""
    rate_bytes = rate_bps / 8
    burst = max(MIN_BURST_BYTES, int(rate_bytes / BURST_FRACTION))
    limit = max(MIN_LIMIT_BYTES, burst + int(rate_bytes * QUEUE_SECONDS))
    return burst, limit
