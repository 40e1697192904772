"""A hung or dead rank ends the job within --timeout + --grace, naming the rank (and, when
bsrun was waiting, the tensor and partition), with no worker left behind."""

import time

import psutil
import pytest

from conftest import WORKERS, last_run, run_bsrun, start_bsrun

SCRIPT = WORKERS / "hang_or_die.py"
TIMEOUT, GRACE = 3, 2
STARTUP_S = 15  # two interpreters importing torch and building groups, on a busy 2-core machine


def run(workdir, *args):
    started = time.monotonic()
    proc = run_bsrun(["--timeout", TIMEOUT, "--grace", GRACE, "-np", 2, "python", SCRIPT, *args],
                     cwd=workdir, timeout=120)
    return proc, time.monotonic() - started, last_run(workdir)


def assert_no_worker_left(summary):
    alive = [r["pid"] for r in summary["ranks"] if "pid" in r and psutil.pid_exists(r["pid"])]
    assert not alive, f"workers still running: {alive}"


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_naming_what_bsrun_waited_for(workdir):
    proc, elapsed, summary = run(workdir, "hang")
    assert proc.returncode == 1
    assert elapsed < TIMEOUT + GRACE + STARTUP_S, f"took {elapsed:.1f} s"
    line = next(l for l in proc.stderr.splitlines() if l.startswith("bsrun: rank 0 failed with exit code 1"))
    assert "waiting for 0.weight" in line or "waiting for 2." in line, line
    assert "partition" in line and "round" in line
    assert_no_worker_left(summary)


@pytest.mark.slow
def test_a_hung_rank_of_a_plain_ddp_model_times_out_too(workdir):
    """A model bsrun leaves as plain DDP (skip_all_reduce_unused_params) keeps DDP's own reducer:
    bsrun's --timeout is the group's."""
    proc, elapsed, summary = run(workdir, "hang", "--find-unused")
    assert proc.returncode == 1 and "bsrun: rank 0 failed with exit code 1" in proc.stderr
    assert elapsed < TIMEOUT + GRACE + STARTUP_S, f"took {elapsed:.1f} s"
    assert_no_worker_left(summary)


@pytest.mark.slow
def test_a_rank_that_dies_mid_training_ends_the_job_with_its_exit_code(workdir):
    proc, elapsed, summary = run(workdir, "die")
    assert proc.returncode == 137
    assert "bsrun: rank 1 failed with exit code 137; the other workers were stopped" in proc.stderr
    assert elapsed < GRACE + STARTUP_S
    assert_no_worker_left(summary)


@pytest.mark.slow
def test_ranks_stuck_in_native_code_holding_the_gil_are_found_by_the_launchers_watchdog(workdir):
    """No collective is waiting, so no timeout inside the workers can fire: the heartbeat stops."""
    proc, elapsed, summary = run(workdir, "hold-gil")
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = next(l for l in proc.stderr.splitlines() if "stopped responding" in l)
    assert line.startswith("bsrun: rank ") and f"--timeout {TIMEOUT}" in line, line
    assert elapsed < TIMEOUT + GRACE + STARTUP_S, f"took {elapsed:.1f} s"
    assert all("pid" in r for r in summary["ranks"]), "the launcher records the pids of ranks without a report"
    assert_no_worker_left(summary)


@pytest.mark.slow
def test_a_rank_that_exits_early_is_not_taken_for_a_hung_one(workdir):
    """Its heartbeat stops with its exit; the job goes on until the other rank is done."""
    script = workdir / "uneven.py"
    script.write_text("import os, time\nif os.environ['RANK'] == '1':\n    time.sleep(3 * %d)\n" % TIMEOUT)
    started = time.monotonic()
    proc = run_bsrun(["--timeout", TIMEOUT, "-np", 2, "python", script], cwd=workdir, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "stopped responding" not in proc.stderr
    assert time.monotonic() - started > 3 * TIMEOUT


SLEEPER = """import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(f"pid-{os.environ['RANK']}", "w").write(f"{os.getpid()} {child.pid}")
time.sleep(120)
"""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("launch", [["-np", 2, "python"], ["torchrun", "--standalone", "--nproc-per-node", 2],
                                    ["python", WORKERS / "any_spawn.py", "--sleep"]],
                         ids=["bsrun-np", "bsrun-torchrun", "bsrun-python-mp-spawn"])
def test_a_launcher_killed_outright_leaves_no_worker_behind(workdir, launch):
    """SIGKILL (or the OOM killer) gives the launcher no chance to stop its workers: they
    notice it is gone and end themselves and what they started, also under a foreign
    launcher (torchrun) that would otherwise keep them, and when they are workers because
    they built a DDP model in processes that torch.multiprocessing.spawn started."""
    script = workdir / "sleeper.py"
    script.write_text(SLEEPER)
    proc = start_bsrun([*launch, workdir if "--sleep" in launch else script], cwd=workdir)
    try:
        deadline = time.monotonic() + 60
        while not all((workdir / f"pid-{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all((workdir / f"pid-{r}").exists() for r in (0, 1)), "the workers did not start"
        launched = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        workers = [int(pid) for r in (0, 1) for pid in (workdir / f"pid-{r}").read_text().split()]
        assert set(workers) <= set(launched)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in launched) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in launched if not gone(pid)]
    for pid in left:  # do not leave them to the next test
        psutil.Process(pid).kill()
    assert not left, f"still running 10 s after the launcher was killed: {left}"
