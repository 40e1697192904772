"""`bsrun torchrun --nnodes 2 ...` run on each of two hosts (emulated: network namespaces):
the job trains scheduled across them, and a config that differs between the nodes is
reported and resolved to rank 0's."""

import os
import subprocess
import sys

import pytest

from bsrun.launch.netem import EmulatedNetwork
from conftest import WORKERS, bsrun_env, last_run

pytestmark = [pytest.mark.root, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")]


def test_two_nodes_of_torchrun_with_c10d_rendezvous(workdir):
    mismatch = "differ from rank 0's"
    with EmulatedNetwork(2, None) as net:
        procs = []
        for node in range(2):
            cwd = workdir / f"node{node}"
            cwd.mkdir()
            knobs = ["--partition", "1MB"] if node == 1 else []
            cmd = net.wrap(node, [sys.executable, "-m", "bsrun", *knobs, "torchrun", "--nnodes", "2",
                                  "--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                  "--rdzv-endpoint", f"{net.master_addr}:29555",
                                  "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", net.hosts[node].addr,
                                  str(WORKERS / "ddp_smoke.py")])
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=bsrun_env(GLOO_SOCKET_IFNAME="eth0"),
                                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        outputs = []
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=120)[0])
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(outputs)
    for node in range(2):
        ranks = last_run(workdir / f"node{node}")["ranks"]
        assert any(r.get("mode") == "scheduled" and r.get("partitions", 0) > 0 for r in ranks), ranks
    assert sum(out.count(mismatch) for out in outputs) == 1, "\n---\n".join(outputs)
