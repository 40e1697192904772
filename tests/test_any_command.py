"""Any launcher, any framework: `bsrun COMMAND...` runs the command as it runs without bsrun,
and a process becomes a scheduled worker where it builds its DDP model, whoever started it
(torch.multiprocessing.spawn, torchrun under a shell script; accelerate launch is in test_frameworks.py)."""

import json
import shutil
import sys

import pytest
import torch

from conftest import WORKERS, assert_same_state, assert_scheduled, bsrun_env, last_run, run_as_group, run_bsrun


def run_plain(args, cwd, env=None, timeout=180):
    """The same command without bsrun (its workers end the group with
    exact_common.end_process_group, past torch's gloo teardown race)."""
    proc = run_as_group(args, timeout, cwd=cwd, env=env or bsrun_env())
    assert proc.returncode == 0, f"{args} without bsrun exited {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc


def assert_scheduled_on_both_ranks(workdir):
    summary = last_run(workdir)
    assert summary["kind"] == "wrap" and summary["exit_code"] == 0
    assert_scheduled(summary)
    assert all(r["steps"] > 0 for r in summary["ranks"]), summary["ranks"]


def assert_same_result(workdir, plain, sched):
    assert_same_state(torch.load(workdir / plain), torch.load(workdir / sched))


def test_workers_that_mp_spawn_starts_are_scheduled(workdir):
    script = WORKERS / "any_spawn.py"
    run_plain([sys.executable, script, "--out", "plain.pt"], workdir)
    proc = run_bsrun(["python", script, "--out", "sched.pt"], cwd=workdir, check=True, timeout=180)
    assert_scheduled_on_both_ranks(workdir)
    assert "bsrun: 2 ranks" in proc.stderr and "mode scheduled" in proc.stderr
    assert_same_result(workdir, "plain.pt", "sched.pt")


def test_unscheduled_spawned_workers_are_still_listed(workdir):
    run_bsrun(["--no-schedule", "python", WORKERS / "any_spawn.py", "--out", "off.pt"], cwd=workdir, check=True,
              timeout=180)
    summary = last_run(workdir)
    assert [(r["rank"], r["mode"]) for r in summary["ranks"]] == [(0, "off"), (1, "off")]


def test_a_shell_script_that_calls_torchrun_is_scheduled(workdir):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    (workdir / "run.sh").write_text(f"set -e\n{torchrun} --standalone --nproc-per-node 2 "
                                    f"{WORKERS / 'any_train.py'} --out \"$1\"\n")
    run_plain(["bash", "run.sh", "plain.pt"], workdir)
    run_bsrun(["bash", "run.sh", "sched.pt"], cwd=workdir, check=True, timeout=180)
    assert_scheduled_on_both_ranks(workdir)
    assert_same_result(workdir, "plain.pt", "sched.pt")


def test_bare_python_sets_no_rank_variables(workdir):
    proc = run_bsrun(["python", WORKERS / "envdump.py", workdir], cwd=workdir, check=True)
    env = json.loads((workdir / "env-None.json").read_text())
    assert env["RANK"] is None and env["WORLD_SIZE"] is None and env["MASTER_ADDR"] is None
    assert env["LOCAL_RANK"] is None and env["BSRUN_ACTIVE"] == "1" and env["bsrun_bootstrapped"]
    summary = last_run(workdir)
    assert summary["kind"] == "wrap" and summary["ranks"] == [] and summary["exit_code"] == 0
    assert "no data-parallel worker" in proc.stderr and "unknown" not in proc.stderr
    plan = json.loads(run_bsrun(["--dry-run", "--json", "python", "train.py"], cwd=workdir, check=True).stdout)
    assert plan["kind"] == "wrap" and [w["argv"] for w in plan["workers"]] == [["python", "train.py"]]
    assert "RANK" not in plan["workers"][0]["env"] and plan["workers"][0]["env"]["BSRUN_ACTIVE"] == "1"


def test_a_single_process_script_that_steps_an_optimizer_prints_nothing_of_bsruns(workdir):
    (workdir / "single.py").write_text(
        "import torch\nm = torch.nn.Linear(4, 2)\nopt = torch.optim.Adam(m.parameters())\n"
        "for _ in range(3):\n    opt.zero_grad()\n    m(torch.randn(3, 4)).sum().backward()\n    opt.step()\n"
        "torch.save(m.state_dict(), 'm.pt')\nprint('trained')\n")
    proc = run_bsrun(["python", "single.py"], cwd=workdir, check=True)
    assert proc.stdout == "trained\n"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bsrun: no data-parallel worker"), proc.stderr


def test_a_command_that_does_not_exist_is_the_one_refusal(workdir):
    proc = run_bsrun(["no-such-command-here", "--flag"], cwd=workdir)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert lines == ["bsrun: error: command 'no-such-command-here' not found on PATH; nothing was started"], \
        proc.stderr
    assert not (workdir / ".bsrun" / "last-run.json").exists(), "nothing may be started"


def test_any_other_command_runs_as_given(workdir):
    proc = run_bsrun(["bash", "-c", "echo \"$BSRUN_ACTIVE ${RANK:-none}\"; exit 3"], cwd=workdir)
    assert proc.returncode == 3 and proc.stdout == "1 none\n", proc.stderr
    assert last_run(workdir)["exit_code"] == 3
