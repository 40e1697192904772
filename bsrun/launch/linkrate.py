"""Measuring the rate an emulated link achieves: one short TCP transfer between two hosts.

The launcher reports it next to the rate it set, so a user sees what the shaping gives.
"""

from __future__ import annotations

import subprocess
import sys
import threading

from bsrun.launch.netns import NetemError


_SERVER = r"""
import socket, sys, time
srv = socket.socket()
srv.bind((sys.argv[1], 0))
srv.listen(1)
srv.settimeout(float(sys.argv[2]))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.settimeout(float(sys.argv[2]))
buf = bytearray(1 << 20)
first = conn.recv_into(buf)
start = time.monotonic()
total = 0
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    total += n
print(total, time.monotonic() - start, flush=True)
"""

_CLIENT = r"""
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
chunk = memoryview(bytes(1 << 20))
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    conn.sendall(chunk)
conn.shutdown(socket.SHUT_WR)
conn.recv(1)
"""


def measure_tcp(net, src: int, dst: int, seconds: float) -> float:
    """Run a tiny receiver in dst and a sender in src; return bit/s."""
    budget = seconds + 15.0
    server = subprocess.Popen(
        net.wrap(dst, [sys.executable, "-c", _SERVER, net.hosts[dst].addr, str(budget)]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    client = None
    try:
        port = _read_line(server, timeout=10.0)
        client = subprocess.Popen(
            net.wrap(src, [sys.executable, "-c", _CLIENT, net.hosts[dst].addr, port, str(seconds)]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        out, err = server.communicate(timeout=budget)
        _, client_err = client.communicate(timeout=5.0)
        if server.returncode != 0 or client.returncode != 0:
            detail = (err.strip() or client_err.strip()).splitlines()[-1:] or ["no output"]
            raise NetemError(f"the rate measurement between emulated hosts failed: {detail[0]}")
        total, elapsed = out.split()
        return int(total) * 8 / float(elapsed)
    except subprocess.TimeoutExpired:
        raise NetemError(f"the rate measurement did not finish in {budget:.0f} s") from None
    finally:
        for proc in (client, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    """First stdout line of proc, or NetemError if it does not come in time."""
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not result or not result[0].strip():
        raise NetemError("the rate-measurement receiver did not start")
    return result[0].strip()
