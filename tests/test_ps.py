"""--arch ps: workers push partitions to summation servers and pull the sums, scheduled by
the same core; the result equals plain DDP's, and a dead server ends the job cleanly."""

import os
import signal
import time

import psutil
import pytest

from conftest import WORKERS, assert_same_state, bsrun_namespaces, run_bsrun, start_bsrun
from test_equivalence import CASES, train

SCRIPT = WORKERS / "train_equiv.py"
RUNS = [  # (case, servers, extra flags)
    ("adam", 1, ["--partition", "1KiB", "--credit", "4x"]),
    ("adam", 2, ["--partition", "1KiB", "--credit", "4x"]),
    ("rmsprop-batchnorm", 2, ["--partition", "64MB"]),
    ("no-sync-accumulation", 2, ["--partition", "tensor", "--order", "fifo"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("case,servers,flags", RUNS, ids=[f"{c}-{s}servers-{f[1]}" for c, s, f in RUNS])
def test_parameter_servers_give_the_parameters_of_plain_ddp(workdir, case, servers, flags):
    plain, _ = train(workdir, "plain", CASES[case], ["--no-schedule"])
    ps, run = train(workdir, "ps", CASES[case], ["--arch", "ps", "--servers", servers, *flags])
    assert [r["mode"] for r in run["ranks"]] == ["scheduled", "scheduled"], "the servers are not ranks"
    assert run["config"]["arch"] == "ps" and run["config"]["servers"] == servers
    r0 = run["ranks"][0]
    assert r0["partitions"] > 0 and r0["bytes"] > 0
    if flags[1] == "1KiB":
        assert r0["partitions"] > 10 * r0["rounds"]
    assert_same_state(ps, plain)


def _servers_of(proc):
    return [p for p in psutil.Process(proc.pid).children(recursive=True)
            if "bsrun.sched.ps_server" in " ".join(p.cmdline())]


@pytest.mark.slow
def test_a_killed_server_ends_the_job_with_a_clear_message_and_no_process_left(workdir):
    proc = start_bsrun(["--arch", "ps", "--servers", 2, "--grace", 2, "-np", 2, "python", SCRIPT,
                        "--steps", 100000, "--out", workdir / "never.pt"], workdir)
    try:
        deadline = time.monotonic() + 60
        servers = []
        while time.monotonic() < deadline:  # training: both servers connected to both workers
            servers = _servers_of(proc)
            if len(servers) == 2 and all(len([c for c in s.net_connections() if c.status == "ESTABLISHED"]) >= 2
                                         for s in servers):
                break
            time.sleep(0.2)
        assert len(servers) == 2, "the servers did not start"
        everything = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        time.sleep(2)
        os.kill(servers[1].pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 137, err[-2000:]
    assert "bsrun: parameter server 1 failed with exit code 137; the workers were stopped" in err, err[-2000:]
    left = [pid for pid in everything if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not left, f"processes left: {left}"


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_servers_on_hosts_of_their_own_on_an_emulated_network(workdir):
    plain, _ = train(workdir, "plain", CASES["adam"], ["--no-schedule"])
    ps, run = train(workdir, "ps", CASES["adam"], ["--emulate-bandwidth", "1gbit", "--arch", "ps", "--servers", 2,
                                                   "--partition", "16KiB"])
    assert [r["mode"] for r in run["ranks"]] == ["scheduled", "scheduled"]
    assert_same_state(ps, plain)
    assert not bsrun_namespaces(), "namespaces left behind"


def test_bad_ps_input_ends_in_one_line_before_any_launch(workdir):
    for args, message in ((["--arch", "pss"], "--arch must be one of allreduce, ps"),
                          (["--arch", "ps", "--servers", "0"], "--servers must be at least 1"),
                          (["--arch", "ps", "--no-schedule"], "cannot go with --no-schedule")):
        proc = run_bsrun([*args, "-np", 2, "python", SCRIPT, "--out", "x.pt"], cwd=workdir)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    proc = run_bsrun(["--arch", "ps", "torchrun", "--nproc-per-node", 2, SCRIPT], cwd=workdir)
    assert proc.returncode == 2 and "--arch ps goes with `-np N python ...`" in proc.stderr, proc.stderr
