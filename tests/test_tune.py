"""`bsrun tune` (issue 7): every trial is a real launch of a tiny DDP job on 2 gloo ranks.

The promises: one journal record per trial, appended as it ends, so a tuner stopped by
SIGTERM or SIGKILL resumes; a failing, hanging or short trial is recorded with its
reason and tuning goes on; a knob fixed on the command line stays out of the search;
the winner is committed and the next `bsrun` run of the same job uses it; a corrupt
journal is moved aside with a warning.
"""

import json
import signal
import time

import psutil
import pytest

from bsrun.cli import job_of
from bsrun.config import parse_size
from conftest import WORKERS, last_run, run_bsrun, signal_when, start_bsrun

TARGET = WORKERS / "tune_target.py"
DEFAULTS = {"partition": "4MiB", "credit": "2x"}
TUNED = "tuned .bsrun/tuned.json"


def tune_args(*script_args, trials=3, recheck=1, options=()):
    return ["tune", "--trials", trials, "--recheck", recheck, "--steps", 3, "--warmup", 1, *options,
            "-np", 2, "--grace", 2, "python", TARGET, *script_args]


def journal(cwd) -> list[dict]:
    """The job's journal, every line parsed (a half-written line fails here)."""
    (path,) = (cwd / ".bsrun" / "tune").glob("*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def trials(records, *kinds):
    return [r for r in records if r["type"] == "trial" and (not kinds or r["kind"] in kinds)]


def gone(pid_files, timeout=15.0) -> bool:
    pids = [int(p.read_text()) for p in pid_files]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Tune 3 trials + 1 recheck, stopped by SIGTERM in trial 2 and by SIGKILL in trial 3."""
    cwd = tmp_path_factory.mktemp("tune")
    pids = cwd / "pids"
    pids.mkdir()
    args = tune_args("--pid-dir", pids, "--sleep", 0.2)
    proc = start_bsrun(args, cwd)

    def trial_2_running():
        return (cwd / ".bsrun" / "tune").exists() and len(trials(journal(cwd))) == 1 \
            and len(list(pids.glob("pid-2-*"))) == 2

    code, err = signal_when(proc, trial_2_running, signal.SIGTERM, "trial 2 starting", settle=0.5, timeout=90)
    stages = {"sigterm": (code, err, journal(cwd), gone(pids.glob("pid-2-*")))}
    proc = start_bsrun(args, cwd)

    def trial_3_running():
        return len(trials(journal(cwd))) == 2 and len(list(pids.glob("pid-3-*"))) == 2

    code, err = signal_when(proc, trial_3_running, signal.SIGKILL, "trial 3 starting", settle=0.5, timeout=90)
    stages["sigkill"] = (code, err, journal(cwd), gone(pids.glob("pid-3-*")))
    stages["final"] = run_bsrun(args, cwd=cwd, check=True, timeout=180)
    return cwd, args, stages


def test_a_stopped_tuning_run_keeps_its_journal_and_resumes(resumed):
    cwd, _, stages = resumed
    code, err, records, workers_gone = stages["sigterm"]
    assert code == 128 + signal.SIGTERM, err
    assert "tuning stopped by SIGTERM" in err and "run the same command to resume" in err
    assert workers_gone, "the trial that was running must be stopped with the tuner"
    header, first = records
    assert header["type"] == "job" and header["world_size"] == 2
    assert header["space"]["searched"] == {"partition": ["64KiB", "128MiB"], "credit": ["1x", "16x"]}
    assert first["n"] == 1 and first["kind"] == "search" and first["config"] == DEFAULTS, \
        "the first trial runs bsrun's defaults"
    assert first["status"] == "ok" and len(first["step_times"]) == 3 and first["step_s"] >= 0.2
    assert first["ran_with"] == {"partition": 4 * 2**20, "credit_bytes": 8 * 2**20, "world_size": 2}

    code, _, records, workers_gone = stages["sigkill"]
    assert code == -signal.SIGKILL
    assert workers_gone, "a trial's launch ends with its tuner, even one killed by SIGKILL"
    assert records[:2] == stages["sigterm"][2], "the journal is append-only"
    assert [r["n"] for r in trials(records)] == [1, 2]

    final = stages["final"]
    assert "resuming from" in final.stdout and "2 trial(s) already measured" in final.stdout, final.stdout
    records = journal(cwd)
    assert records[:3] == stages["sigkill"][2]
    search, recheck = trials(records, "search"), trials(records, "recheck")
    assert [r["n"] for r in search] == [1, 2, 3] and len(recheck) == 1
    assert all(r["status"] == "ok" for r in search + recheck)
    assert len({json.dumps(r["config"], sort_keys=True) for r in search}) == 3, "each search point is new"
    assert records[-1]["type"] == "commit"

    shown = run_bsrun(["tune", "show"], cwd=cwd, check=True).stdout
    assert "recheck" in shown and "(committed)" in shown and "4MiB" in shown


def test_the_committed_config_is_used_by_the_next_run_of_the_same_job(resumed):
    cwd, args, _ = resumed
    commit = journal(cwd)[-1]
    tuned = json.loads((cwd / ".bsrun" / "tuned.json").read_text())
    (entry,) = tuned["jobs"].values()
    assert entry["config"] == commit["config"] and set(entry["config"]) == {"partition", "credit"}
    assert entry["world_size"] == 2 and entry["measurements"] and entry["step_s"] > 0
    launch = args[args.index("-np"):]
    plan = json.loads(run_bsrun(["--dry-run", "--json", *launch], cwd=cwd, check=True).stdout)
    assert plan["config"]["sources"]["partition"] == TUNED and plan["config"]["sources"]["credit"] == TUNED
    partition = parse_size(entry["config"]["partition"])
    assert plan["config"]["partition"] == partition and plan["config"]["credit"] == entry["config"]["credit"]
    text = run_bsrun(["--dry-run", *launch], cwd=cwd, check=True).stdout
    assert TUNED in text

    proc = run_bsrun(launch, cwd=cwd, check=True)
    line = f"bsrun: using tuned config partition={partition}, credit={entry['config']['credit']} from .bsrun/tuned.json"
    assert line in proc.stderr.splitlines(), proc.stderr
    run = last_run(cwd)
    assert run["config"]["partition"] == partition and run["config"]["sources"]["partition"] == TUNED
    assert all(r["steps"] == 20 and r["exit_code"] == 0 for r in run["ranks"]), "a normal run is not a trial"

    for other in (["-np", 1, *launch[2:]], ["--arch", "ps", *launch]):  # another world size; servers
        plan = json.loads(run_bsrun(["--dry-run", "--json", *other], cwd=cwd, check=True).stdout)
        assert plan["config"]["sources"]["partition"] == "default", other


def test_a_failing_hanging_or_short_trial_is_recorded_and_tuning_goes_on(workdir):
    args = tune_args("--fail-trial", 1, "--hang-trial", 2, "--short-trial", 3, trials=4, recheck=1,
                     options=["--trial-timeout", 20])
    proc = run_bsrun(args, cwd=workdir, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    failed, hung, short, ok = trials(journal(workdir), "search")
    assert failed["status"] == "failed"
    assert failed["reason"].startswith("exited with code 1: rank 1 failed with exit code 1"), failed["reason"]
    assert "RuntimeError: injected failure in trial 1" in failed["reason"]
    assert "injected failure" in (workdir / failed["log"]).read_text(), "the trial's whole output is kept"
    assert hung["status"] == "timeout" and "did not finish within 20 s" in hung["reason"]
    assert short["status"] == "failed"
    assert short["reason"] == "the job ended after 2 optimizer steps, before the trial's 4 (1 warm-up + 3 timed)"
    assert ok["status"] == "ok" and "step_s" not in failed
    (recheck,) = trials(journal(workdir), "recheck")
    assert recheck["config"] == ok["config"], "only a measured config can be a finalist"
    assert json.loads((workdir / ".bsrun" / "tuned.json").read_text())["jobs"]
    assert "injected failure in trial 1" in proc.stdout and "timeout" in proc.stdout


def test_a_knob_fixed_on_the_command_line_is_kept_and_not_searched(workdir):
    args = tune_args(trials=2, recheck=0)
    args[args.index("-np"):args.index("-np")] = ["--partition", "1MB"]
    proc = run_bsrun(args, cwd=workdir, check=True, timeout=120)
    records = journal(workdir)
    assert records[0]["space"] == {"searched": {"credit": ["1x", "16x"]}, "fixed": {"partition": "1MB"}}
    search = trials(records, "search")
    assert len(search) == 2 and all(r["status"] == "ok" for r in search), proc.stdout
    assert all(set(r["config"]) == {"credit"} for r in search)
    assert all(r["ran_with"]["partition"] == 1_000_000 for r in search), "every trial kept --partition 1MB"
    assert search[0]["config"] == {"credit": "2x"} and search[1]["config"] != search[0]["config"]
    assert search[1]["ran_with"]["credit_bytes"] == int(float(search[1]["config"]["credit"][:-1]) * 1_000_000)
    (entry,) = json.loads((workdir / ".bsrun" / "tuned.json").read_text())["jobs"].values()
    assert set(entry["config"]) == {"credit"}, "a fixed knob stays the user's, it is not committed"
    plan = json.loads(run_bsrun(["--dry-run", "--json", *args[args.index("--partition"):]], cwd=workdir,
                                check=True).stdout)
    assert plan["config"]["sources"] == {"partition": "flag", "credit": TUNED, "enabled": "default",
                                         "timeout": "default", "order": "default", "arch": "default",
                                         "servers": "default", "check_every": "default", "adapt": "default"}


def test_a_corrupt_journal_is_moved_aside_with_a_warning(workdir):
    signature, _ = job_of(["python", str(TARGET)], 2, None)
    path = workdir / ".bsrun" / "tune" / f"{signature}.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("{not json\n")
    proc = run_bsrun(tune_args(trials=1, recheck=0), cwd=workdir, check=True, timeout=120)
    assert f"{path.relative_to(workdir)} is corrupt (line 1); moved it to" in proc.stderr, proc.stderr
    (aside,) = path.parent.glob(f"{signature}.jsonl.corrupt-*")
    assert aside.read_text() == "{not json\n"
    records = journal(workdir)
    assert records[0]["type"] == "job" and len(trials(records)) == 1 and records[-1]["type"] == "commit"

    other_space = run_bsrun(tune_args(trials=1, recheck=0, options=["--space", "partition=1MiB:8MiB"]), cwd=workdir)
    assert other_space.returncode == 2 and "was made for another search space" in other_space.stderr
    assert "--fresh" in other_space.stderr and journal(workdir) == records


@pytest.mark.parametrize("options,message", [
    (["--partition", "1MB", "--credit", "2x"], "nothing to tune: credit and partition are fixed by the user"),
    (["--no-schedule"], "tuning needs scheduling on"),
    (["--space", "partition=8MiB:1MiB"], "the lower bound must be below the upper"),
    (["--space", "credit=1MB:2MB"], "--space credit bounds must be multiples of the partition"),
    (["--warmup", "0"], "--warmup"),
])
def test_bad_tuning_input_ends_in_one_line_before_any_launch(workdir, options, message):
    args = tune_args(trials=1)
    at = args.index("-np")
    proc = run_bsrun(args[:at] + options + args[at:], cwd=workdir)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bsrun: error: ") and message in lines[0], proc.stderr
    assert not (workdir / ".bsrun" / "tune").exists()


def test_presim_profiles_once_and_its_fastest_predictions_come_right_after_the_defaults(workdir):
    args = tune_args(trials=3, recheck=0, options=["--presim"])
    proc = run_bsrun(args, cwd=workdir, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = journal(workdir)
    (presim,) = [r for r in records if r["type"] == "presim"]
    assert len(presim["configs"]) == 3 and presim["predicted_s"] == sorted(presim["predicted_s"])
    assert all(t > 0 for t in presim["predicted_s"]) and DEFAULTS not in presim["configs"]
    assert (workdir / presim["profile"] / "trace.json").is_file()
    search = trials(records, "search")
    assert [t["config"] for t in search] == [DEFAULTS, *presim["configs"][:2]]
    assert "--presim proposes partition=" in proc.stdout
    again = run_bsrun(args, cwd=workdir, check=True, timeout=120)  # resumes: no second profile
    assert len([r for r in journal(workdir) if r["type"] == "presim"]) == 1
    assert "profiling the job once" not in again.stdout
