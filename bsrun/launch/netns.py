"""The host side of network emulation: running `ip` and `tc`, and removing leftovers.

Everything bsrun creates carries its owner's pid in its name (bsrun/launch/netem.py
has the scheme), so what a killed owner left can be found and removed by
`cleanup_stale`, and nothing else on the host is ever touched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import psutil

from bsrun.errors import BsrunError

_NETNS_RE = re.compile(r"^bsrun-(\d+)-(\d+)$")
_LINK_RE = re.compile(r"^bsr(?:br(\d+)|v(\d+)x\d+)$")


class NetemError(BsrunError):
    """Anything the user can get wrong or lack when emulating a network."""


# ---------------------------------------------------------------- commands


def require_tools() -> None:
    """Fail with one sentence if iproute2 is missing."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetemError(
                f"the `{tool}` command (iproute2) is not installed; "
                "install iproute2 to emulate a network"
            )


def require_root() -> None:
    """Namespaces, bridges and qdiscs all need CAP_NET_ADMIN; we ask for root."""
    if os.geteuid() != 0:
        raise NetemError(
            "emulating a network needs root (network namespaces, bridges and tc); "
            "run as root or launch without network emulation"
        )


def run(*cmd: str, timeout: float = 20.0) -> str:
    """Run one `ip` / `tc` command; on failure raise NetemError with its stderr."""
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError:
        raise NetemError(
            f"the `{cmd[0]}` command (iproute2) is not installed; "
            "install iproute2 to emulate a network"
        ) from None
    except subprocess.TimeoutExpired:
        raise NetemError(f"`{' '.join(cmd)}` did not finish in {timeout:.0f} s") from None
    if proc.returncode != 0:
        detail = proc.stderr.strip() or proc.stdout.strip() or f"exit code {proc.returncode}"
        raise NetemError(f"`{' '.join(cmd)}` failed: {detail}")
    return proc.stdout


def try_run(*cmd: str) -> bool:
    """Run a removal command, ignoring failure (the thing may already be gone)."""
    try:
        run(*cmd)
        return True
    except NetemError:
        return False


# ---------------------------------------------------------------- discovery


def _list_netns() -> list[str]:
    """Names of all network namespaces `ip netns` knows."""
    out = run("ip", "-j", "netns", "list").strip()
    return [entry["name"] for entry in json.loads(out)] if out else []


def _list_links() -> list[str]:
    """Names of all interfaces in the root namespace."""
    out = run("ip", "-j", "link", "show").strip()
    return [entry["ifname"] for entry in json.loads(out)] if out else []


def _owner_of_netns(name: str) -> int | None:
    match = _NETNS_RE.match(name)
    return int(match.group(1)) if match else None


def _owner_of_link(name: str) -> int | None:
    match = _LINK_RE.match(name)
    if not match:
        return None
    return int(match.group(1) or match.group(2))


def remove_owned(owner_filter) -> list[str]:
    """Remove every bsrun namespace / link whose owner pid passes the filter.

    Veths go first (deleting one end deletes both, even when a straggling
    process keeps its namespace alive), then bridges, then namespaces.
    Deleting an interface also deletes its qdiscs.
    """
    removed: list[str] = []
    links = [n for n in _list_links() if (p := _owner_of_link(n)) is not None and owner_filter(p)]
    for name in sorted(links, key=lambda n: n.startswith("bsrbr")):  # veths, then bridges
        if try_run("ip", "link", "del", name):
            removed.append(name)
    for name in _list_netns():
        owner = _owner_of_netns(name)
        if owner is not None and owner_filter(owner) and try_run("ip", "netns", "del", name):
            removed.append(name)
    return removed


def cleanup_stale() -> list[str]:
    """Remove namespaces, bridges and veths left by bsrun owners that are dead.

    An owner killed with SIGKILL cannot clean up after itself; the next run
    does it here. Those of live owners are left alone (so is a dead owner's
    whose pid has since been reused: erring towards keeping is safe).
    """
    require_root()
    require_tools()
    return remove_owned(lambda pid: not psutil.pid_exists(pid))
