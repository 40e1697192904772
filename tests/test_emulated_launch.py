"""`bsrun --emulate-bandwidth`: real DDP across network namespaces, nothing left behind."""

import os
import signal

import pytest

from conftest import WORKERS, bsrun_namespaces, last_run, run_bsrun, signal_when, start_bsrun

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root")]


def test_ddp_across_two_emulated_hosts(workdir):
    proc = run_bsrun(["--emulate-bandwidth", "1gbit", "-np", 2, "python", WORKERS / "ddp_smoke.py"],
                     cwd=workdir, check=True, timeout=120)
    assert "emulated network: 2 hosts, set 1 Gbit/s, measured" in proc.stderr
    measured = float(proc.stderr.split("measured ")[1].split(" ")[0])
    assert 0.85 <= measured <= 1.05
    assert all(r["mode"] == "scheduled" and r["partitions"] > 0 for r in last_run(workdir)["ranks"])
    assert bsrun_namespaces() == []


def test_sigterm_during_an_emulated_run_removes_the_network(workdir):
    proc = start_bsrun(["--grace", 2, "--emulate-bandwidth", "500mbit", "-np", 2, "python", "-c",
                        "import time; time.sleep(60)"], workdir)
    code, err = signal_when(proc, lambda: len(bsrun_namespaces(proc.pid)) == 2, signal.SIGTERM,
                            "the emulated hosts coming up", settle=1.5)  # past the rate check
    assert code == 143, err
    assert bsrun_namespaces() == []


def test_a_failing_rank_on_the_emulated_network_still_cleans_up(workdir):
    proc = run_bsrun(["--grace", 2, "--emulate-bandwidth", "1gbit", "-np", 2, "python", "-c",
                      "import os, sys, time; time.sleep(0.5); sys.exit(4 if os.environ['RANK'] == '1' else 0)"],
                     cwd=workdir, timeout=60)
    assert proc.returncode == 4 and "rank 1 failed with exit code 4" in proc.stderr
    assert bsrun_namespaces() == []


def test_emulated_network_goes_only_with_bsruns_own_launcher(workdir):
    proc = run_bsrun(["--emulate-bandwidth", "1gbit", "torchrun", "--standalone", "x.py"], cwd=workdir)
    assert proc.returncode == 2 and "goes with `-np N python ...`" in proc.stderr
