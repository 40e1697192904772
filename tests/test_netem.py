"""The emulated network: parsing, lifecycle, shaping, cleanup, and real gloo traffic."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bsrun.launch import netem
from bsrun.launch.netem import EmulatedNetwork, NetemError, cleanup_stale, parse_latency, parse_rate

REPO = Path(__file__).resolve().parents[1]

root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces and tc")


def needs_root(fn):
    return pytest.mark.root(root(fn))


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True, timeout=10).stdout


def leftovers(pid: int) -> list[str]:
    """Namespaces and interfaces named for owner `pid` that still exist."""
    netns = [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]
    links = [m.group(1) for m in re.finditer(r"^\d+: ([^:@]+)", _ip("-o", "link", "show"), re.M)]
    ours = re.compile(rf"^(bsrun-{pid}-\d+|bsrbr{pid}|bsrv{pid}x\d+)$")
    return [name for name in netns + links if ours.match(name)]


# ---------------------------------------------------------------- parsing (no root)


@pytest.mark.parametrize(
    "text, bits",
    [
        ("3gbit", 3_000_000_000),
        ("500mbit", 500_000_000),
        ("100kbit", 100_000),
        ("1.5gbit", 1_500_000_000),
        ("2GBIT", 2_000_000_000),
        ("12345", 12345),
        ("800bit", 800),
        (2_000_000, 2_000_000),
    ],
)
def test_parse_rate_accepts_tc_bit_forms(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["abc", "", "1gbps", "10mbps", "3 gigabit", "-1gbit", "0", "1.2.3mbit", "gbit"])
def test_parse_rate_rejects_anything_else_naming_the_value(text):
    with pytest.raises(NetemError, match=re.escape(repr(text))) as err:
        parse_rate(text)
    assert "--emulate-bandwidth must be" in str(err.value)


def test_parse_rate_names_the_callers_option():
    with pytest.raises(NetemError, match="--bandwidth must be a"):
        parse_rate("fast", option="--bandwidth")


@pytest.mark.parametrize(
    "text, seconds",
    [("100us", 100e-6), ("2ms", 2e-3), ("0.5ms", 0.5e-3), ("1s", 1.0), ("0ms", 0.0), (" 3MS ", 3e-3)],
)
def test_parse_latency_accepts_tc_time_forms(text, seconds):
    assert parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["abc", "", "5", "2 minutes", "-1ms", "1h", "ms"])
def test_parse_latency_rejects_anything_else_naming_the_value(text):
    with pytest.raises(NetemError, match=re.escape(repr(text))):
        parse_latency(text)


def test_tbf_burst_holds_a_gso_packet_and_scales_with_rate():
    burst, limit = netem.tbf_parameters(parse_rate("10mbit"))
    assert burst >= 64 * 1024 and limit > burst
    burst, limit = netem.tbf_parameters(parse_rate("1gbit"))
    assert burst == 1_000_000_000 // 8 // 250 and limit > burst


def test_without_root_it_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetemError, match="needs root"):
        with EmulatedNetwork(2, parse_rate("1gbit")):
            pass


def test_bad_host_count_is_one_sentence():
    with pytest.raises(NetemError, match="1 to 253 hosts"):
        EmulatedNetwork(0, None)


# ---------------------------------------------------------------- lifecycle (root)


@needs_root
def test_namespaces_and_bridge_exist_inside_and_are_gone_after():
    pid = os.getpid()
    with EmulatedNetwork(3, parse_rate("1gbit")) as net:
        names = set(leftovers(pid))
        assert {f"bsrun-{pid}-{i}" for i in range(3)} <= names
        assert f"bsrbr{pid}" in names
        sub = net.subnet
        assert re.fullmatch(r"198\.1[89]\.\d{1,3}\.", sub), sub
        assert [h.addr for h in net.hosts] == [f"{sub}1", f"{sub}2", f"{sub}3"]
        assert net.master_addr == f"{sub}1" and net.gateway_addr == f"{sub}254"
        inside = subprocess.run(net.wrap(2, ["ip", "-o", "addr", "show", "dev", "eth0"]),
                                capture_output=True, text=True, timeout=10).stdout
        assert f"{sub}3/24" in inside
        assert net.env_for(1)["GLOO_SOCKET_IFNAME"] == "eth0"
        # A live owner's network is not stale.
        assert not [n for n in cleanup_stale() if str(pid) in n]
        assert set(leftovers(pid)) == names
    assert leftovers(pid) == []


_OTHER_NETWORK = """
import subprocess, sys
from bsrun.launch.netem import EmulatedNetwork
with EmulatedNetwork(2, None) as net:
    route = subprocess.run(["ip", "route", "get", net.hosts[1].addr], capture_output=True, text=True).stdout
    print(net.subnet, net.bridge, route.split(" dev ")[1].split()[0], flush=True)
    sys.stdin.readline()  # up until the parent has looked
"""


@needs_root
def test_two_networks_at_once_take_their_own_subnets_and_routes():
    """Two emulated launches on one machine (one network per process): the root namespace
    reaches each network's hosts through that network's own bridge."""
    with EmulatedNetwork(2, None) as mine:
        other = subprocess.Popen([sys.executable, "-c", _OTHER_NETWORK], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, cwd=REPO)
        try:
            subnet, bridge, route_dev = other.stdout.readline().split()
            own_dev = _ip("route", "get", mine.hosts[1].addr).split(" dev ")[1].split()[0]
        finally:
            other.communicate("\n", timeout=30)
        assert other.returncode == 0
        assert subnet != mine.subnet
        assert route_dev == bridge and own_dev == mine.bridge
    assert leftovers(other.pid) == [] and leftovers(os.getpid()) == []


@needs_root
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_exception_inside_the_block_still_cleans_up(error):
    with pytest.raises(error):
        with EmulatedNetwork(2, parse_rate("500mbit")):
            assert leftovers(os.getpid())
            raise error("boom")
    assert leftovers(os.getpid()) == []


@needs_root
def test_a_failure_half_way_through_setup_cleans_up(monkeypatch):
    real = EmulatedNetwork._create_host

    def fail_on_second(self, host):
        if host.index == 1:
            raise NetemError("injected failure")
        real(self, host)

    monkeypatch.setattr(EmulatedNetwork, "_create_host", fail_on_second)
    with pytest.raises(NetemError, match="injected"):
        with EmulatedNetwork(2, parse_rate("1gbit")):
            pass
    assert leftovers(os.getpid()) == []


@needs_root
def test_close_is_idempotent_and_a_second_network_can_follow():
    net = EmulatedNetwork(2, None)
    with net:
        net.close()
        net.close()
        assert leftovers(os.getpid()) == []
    with EmulatedNetwork(2, None):
        assert leftovers(os.getpid())
    assert leftovers(os.getpid()) == []


@needs_root
def test_latency_either_works_or_says_netem_is_missing():
    try:
        with EmulatedNetwork(2, parse_rate("1gbit"), latency_s=0.002):
            pass
    except NetemError as err:
        assert "netem" in str(err)
    assert leftovers(os.getpid()) == []


# ---------------------------------------------------------------- shaping (root)


@needs_root
@pytest.mark.parametrize("rate", ["1gbit", "500mbit"])
def test_shaped_rate_is_within_15_percent(rate):
    with EmulatedNetwork(2, parse_rate(rate)) as net:
        achieved = net.measure_rate(1.0)
    assert achieved == pytest.approx(parse_rate(rate), rel=0.15), f"{rate}: {achieved / 1e6:.0f} Mbit/s"


# ---------------------------------------------------------------- killed owner (root)

_OWNER = textwrap.dedent(
    """
    import time
    from bsrun.launch.netem import EmulatedNetwork
    net = EmulatedNetwork(2, 100_000_000)
    net.open()
    print("up", flush=True)
    time.sleep(60)
    """
)


@needs_root
def test_cleanup_stale_removes_what_a_killed_owner_left():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, env=env, text=True)
    try:
        ready, _, _ = select.select([owner.stdout], [], [], 20)
        assert ready and owner.stdout.readline().strip() == "up", "the owner never brought its network up"
        assert len(leftovers(owner.pid)) == 5  # 2 namespaces, 2 veths, 1 bridge
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        assert len(leftovers(owner.pid)) == 5  # SIGKILL left it all behind

        removed = cleanup_stale()

        assert set(leftovers(owner.pid)) == set() and {f"bsrbr{owner.pid}", f"bsrun-{owner.pid}-0"} <= set(removed)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=10)
        if leftovers(owner.pid):
            cleanup_stale()


@needs_root
def test_a_normal_interpreter_exit_cleans_up_without_close():
    script = "from bsrun.launch.netem import EmulatedNetwork\nEmulatedNetwork(2, 100_000_000).open()\nprint('up')"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        out, err = owner.communicate(timeout=30)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=10)
    assert owner.returncode == 0 and out.strip() == "up", err
    assert leftovers(owner.pid) == []  # the atexit handler removed it all


# ---------------------------------------------------------------- real gloo traffic (root)

_WORKER = textwrap.dedent(
    """
    import datetime, torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    t = torch.full((1 << 20,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.all(t == 3.0), t[:4]
    dist.destroy_process_group()
    print("ok", rank, flush=True)
    """
)


def _tx_bytes(dev: str) -> int:
    import json

    return json.loads(_ip("-s", "-j", "link", "show", "dev", dev))[0]["stats64"]["tx"]["bytes"]


@needs_root
def test_gloo_all_reduce_across_the_namespaces():
    with EmulatedNetwork(2, parse_rate("1gbit")) as net:
        to_rank1 = f"bsrv{os.getpid()}x1"  # the bridge -> host 1 direction
        before = _tx_bytes(to_rank1)
        workers = []
        try:
            for rank in range(2):
                env = {
                    **os.environ,
                    "PYTHONPATH": str(REPO),
                    "OMP_NUM_THREADS": "1",
                    "RANK": str(rank),
                    "LOCAL_RANK": "0",
                    "WORLD_SIZE": "2",
                    "MASTER_ADDR": net.master_addr,
                    "MASTER_PORT": "29533",
                    **net.env_for(rank),
                }
                workers.append(subprocess.Popen(net.wrap(rank, [sys.executable, "-c", _WORKER]), env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            outputs = [w.communicate(timeout=60)[0] for w in workers]
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait(timeout=10)
        for rank, (w, out) in enumerate(zip(workers, outputs)):
            assert w.returncode == 0, f"rank {rank} exited {w.returncode}:\n{out}"
            assert f"ok {rank}" in out
        # The 4 MB tensor really crossed the emulated link, not loopback.
        assert _tx_bytes(to_rank1) - before > 2 * 1024 * 1024
    assert leftovers(os.getpid()) == []
