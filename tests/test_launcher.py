"""The launcher's promises (issue: run unmodified training scripts under bsrun)."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import WORKERS, bsrun_env, last_run, run_bsrun, signal_when, start_bsrun


def read_env(folder, rank):
    return json.loads((Path(folder) / f"env-{rank}.json").read_text())


def pids_in(folder):
    return [int(p.read_text()) for p in Path(folder).glob("*") if p.name.startswith(("pid-", "grandchild-"))]


def wait_gone(pids, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def test_each_rank_sees_the_torchrun_environment(workdir):
    run_bsrun(["-np", 2, "--partition", "2MB", "python", WORKERS / "envdump.py", workdir, "--x", "1"],
              cwd=workdir, env=bsrun_env(OMP_NUM_THREADS=None), check=True)
    envs = [read_env(workdir, r) for r in (0, 1)]
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["OMP_NUM_THREADS"] == "1", "N > 1 workers get OMP_NUM_THREADS=1 when unset"
        assert env["BSRUN_ACTIVE"] == "1" and env["BSRUN_PARTITION"] == "2000000"
        assert env["bsrun_bootstrapped"] and env["stdin_closed"]
        assert env["argv"] == [str(workdir), "--x", "1"], "script arguments pass through untouched"
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    summary = last_run(workdir)
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert all(r["exit_code"] == 0 for r in summary["ranks"])


def test_worker_output_is_prefixed_with_its_rank(workdir):
    proc = run_bsrun(["-np", 2, "python", "-c", "import os; print('hi from', os.environ['RANK'])"],
                     cwd=workdir, check=True)
    lines = set(proc.stdout.splitlines())
    assert {"[0] hi from 0", "[1] hi from 1"} <= lines


def test_a_failing_rank_ends_the_job_with_its_exit_code(workdir):
    started = time.monotonic()
    proc = run_bsrun(["-np", 2, "--grace", 2, "python", WORKERS / "fail_or_sleep.py", workdir],
                     cwd=workdir, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert time.monotonic() - started < 15
    assert "rank 1 failed with exit code 3" in proc.stderr
    pids = pids_in(workdir)
    assert len(pids) == 4, "two workers and their two grandchildren recorded their pids"
    assert wait_gone(pids) == [], "no worker or grandchild may outlive bsrun"
    summary = last_run(workdir)
    assert summary["exit_code"] == 3
    assert {r["rank"]: r["exit_code"] for r in summary["ranks"]}[1] == 3


def test_ctrl_c_tears_everything_down(workdir):
    proc = start_bsrun(["-np", 2, "--grace", 2, "python", WORKERS / "fail_or_sleep.py", workdir, 99], workdir)
    code, err = signal_when(proc, lambda: len(pids_in(workdir)) == 4, signal.SIGINT,
                            "workers and grandchildren starting")
    assert code == 130, err
    assert "stopped by SIGINT" in err
    assert wait_gone(pids_in(workdir)) == []


def test_bsrun_torchrun_reaches_the_bootstrap_in_every_worker(workdir):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    run_bsrun([torchrun, "--standalone", "--nproc-per-node", 2, WORKERS / "envdump.py", workdir],
              cwd=workdir, check=True, timeout=120)
    for rank in (0, 1):
        env = read_env(workdir, rank)
        assert env["bsrun_bootstrapped"], f"rank {rank} did not run bsrun's bootstrap"
        assert env["BSRUN_ACTIVE"] == "1"
    run_bsrun([torchrun, "--standalone", "--nproc-per-node", 2, WORKERS / "ddp_smoke.py"],
              cwd=workdir, check=True, timeout=120)
    summary = last_run(workdir)
    assert summary["kind"] == "wrap"
    assert sorted(r["rank"] for r in summary["ranks"]) == [0, 1]
    assert all(r["mode"] == "scheduled" and r["partitions"] > 0 for r in summary["ranks"])


def test_an_existing_user_sitecustomize_still_runs(workdir):
    site = workdir / "usersite"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = 'yes'\n")
    run_bsrun(["-np", 1, "python", WORKERS / "envdump.py", workdir], cwd=workdir,
              env=bsrun_env(PYTHONPATH=str(site)), check=True)
    env = read_env(workdir, 0)
    assert env["USER_SITE_RAN"] == "yes"
    assert env["bsrun_bootstrapped"]


def test_np_1_runs_one_python_process_as_rank_0_of_1(workdir):
    run_bsrun(["-np", 1, "python", WORKERS / "envdump.py", workdir], cwd=workdir, check=True)
    env = read_env(workdir, 0)
    assert env["WORLD_SIZE"] == "1" and env["bsrun_bootstrapped"]
    assert [r["rank"] for r in last_run(workdir)["ranks"]] == [0]


def test_a_bare_python_command_is_wrapped_not_ranked(workdir):
    """Without -np, `python ...` is run as given (tests/test_any_command.py has the rest)."""
    run_bsrun(["python", WORKERS / "envdump.py", workdir], cwd=workdir, check=True)
    env = read_env(workdir, None)
    assert env["RANK"] is None and env["WORLD_SIZE"] is None and env["bsrun_bootstrapped"]
    assert last_run(workdir)["kind"] == "wrap"


BAD_INPUT = [
    (["--partition", "abc", "-np", 2, "python", "x.py"], "--partition must be a size such as 4MB, or tensor, got 'abc'"),
    (["--partition", "-4MB", "-np", 2, "python", "x.py"], "--partition must be"),
    (["--credit", "0x", "-np", 2, "python", "x.py"], "--credit must be"),
    (["--timeout", "soon", "-np", 2, "python", "x.py"], "--timeout must be"),
    (["-np", 0, "python", "x.py"], "-np must be at least 1, got 0"),
    (["--frobnicate", "python", "x.py"], "No such option"),
    (["-np", 2, "python", "does-not-exist.py"], "script 'does-not-exist.py' not found"),
    (["-np", 2, "ls", "-l"], "-np goes with `python ...`; ls is not Python"),
    (["-np", 2, "torchrun", "x.py"], "-np goes with `python ...`; torchrun takes its own process count"),
    (["--emulate-bandwidth", "1gbit", "python", "x.py"], "--emulate-bandwidth goes with `-np N python ...`"),
    (["--arch", "ps", "bash", "x.sh"], "--arch ps goes with `-np N python ...`"),
    (["--config", "missing.toml", "-np", 2, "python", "x.py"], "cannot read --config missing.toml"),
]


@pytest.mark.parametrize("args,message", BAD_INPUT, ids=[m.split(" ")[0] + str(i) for i, (_, m) in enumerate(BAD_INPUT)])
def test_bad_input_ends_in_one_clear_line_and_exit_code_2(workdir, args, message):
    (workdir / "x.py").write_text("print('must not run')\n")
    proc = run_bsrun(args, cwd=workdir)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bsrun: error: "), proc.stderr
    assert message in lines[0]
    assert "Traceback" not in proc.stderr and "must not run" not in proc.stdout


def test_dry_run_shows_config_sources_commands_and_environment(workdir):
    (workdir / "train.py").write_text("raise SystemExit('must not run')\n")
    (workdir / "knobs.toml").write_text('credit = "8MB"\n')
    proc = run_bsrun(["--dry-run", "--json", "-np", 2, "--partition", "1MB", "--config", "knobs.toml",
                      "python", "train.py", "--lr", "0.1"], cwd=workdir,
                     env=bsrun_env(BSRUN_TIMEOUT="60"), check=True)
    plan = json.loads(proc.stdout)
    assert plan["config"]["sources"] == {"partition": "flag", "credit": "config knobs.toml",
                                         "timeout": "env BSRUN_TIMEOUT", "enabled": "default",
                                         "order": "default", "arch": "default", "servers": "default",
                                         "check_every": "default", "adapt": "default"}
    assert plan["config"]["partition"] == 1_000_000 and plan["config"]["credit_bytes"] == 8_000_000
    assert [w["argv"] for w in plan["workers"]] == [["python", "train.py", "--lr", "0.1"]] * 2
    assert [w["env"]["RANK"] for w in plan["workers"]] == ["0", "1"]
    assert not (workdir / ".bsrun" / "last-run.json").exists()
    text = run_bsrun(["--dry-run", "-np", 2, "python", "train.py"], cwd=workdir, check=True).stdout
    assert "partition" in text and "default" in text and "rank 1: python train.py" in text
    assert "BSRUN_ACTIVE=1" in text
    text = run_bsrun(["--dry-run", "--arch", "ps", "--servers", 2, "-np", 2, "python", "train.py"], cwd=workdir,
                     check=True).stdout
    assert "parameter server 1:" in text and "bsrun.sched.ps_server" in text and "BSRUN_PS_RANK=3" in text


def test_run_summary_is_kept_per_run_and_as_last_run(workdir):
    run_bsrun(["-np", 2, "python", WORKERS / "ddp_smoke.py"], cwd=workdir, check=True)
    run_bsrun(["--no-schedule", "-np", 2, "python", WORKERS / "ddp_smoke.py"], cwd=workdir, check=True)
    runs = sorted((workdir / ".bsrun" / "runs").glob("*.json"))
    assert len(runs) == 2
    first = json.loads(runs[0].read_text())
    assert first["config"]["enabled"] is True
    for rank in first["ranks"]:
        assert rank["mode"] == "scheduled" and rank["steps"] == 3 and rank["rounds"] == 3
        assert rank["partitions"] >= 3 and rank["bytes"] > 0 and rank["exit_code"] == 0
    assert {r["mode"] for r in last_run(workdir)["ranks"]} == {"off"}
    assert not list((workdir / ".bsrun").glob(".reports-*")), "per-rank report folders are removed"


def test_the_launcher_does_not_import_torch(workdir):
    """Start-up stays fast: torch is imported by the workers that need it, never by bsrun."""
    (workdir / "x.py").write_text("print('ok')\n")
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "bsrun", "-np", "1", "python", "x.py"],
                          cwd=workdir, env=bsrun_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "ok" in proc.stdout
    imported = [line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line]
    assert "bsrun.cli" in imported, "the import trace must cover bsrun itself"
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]
