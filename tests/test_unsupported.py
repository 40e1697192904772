"""Scripts bsrun cannot schedule as usual: the right fallback, one line saying so, and the
same parameters as the unscheduled run (allclose rtol 1e-5)."""

import pytest
import torch

from conftest import WORKERS, assert_same_state, last_run, run_bsrun

SCRIPT = WORKERS / "odd_models.py"

# case -> (mode bsrun must report, the line it must print once; None: no line)
CASES = {
    "sparse": ("fallback", "not scheduling this model (sparse gradients); it runs as plain DDP"),
    "find-unused": ("scheduled", None),  # DDP's unused-parameter semantics (tests/test_ddp_semantics.py)
    "mixed-dtypes": ("scheduled", None),
    "shared": ("scheduled", None),
    "twice": ("scheduled", None),
    "comm-hook": ("scheduled", None),  # the hook runs on bsrun's partitions (tests/test_comm_hooks.py)
    "comm-hook-other-group": ("fallback", "not scheduling this model (the DDP comm hook allreduce_hook on a "
                                          "process group other than the model's); it runs as plain DDP"),
    "no-ddp": ("off", "nothing was scheduled: this script built no DistributedDataParallel model"),
}


def train(workdir, case, flags):
    out = workdir / f"{case}-{'plain' if flags else 'bsrun'}.pt"
    proc = run_bsrun([*flags, "-np", 2, "python", SCRIPT, case, out], cwd=workdir, check=True)
    return torch.load(out), last_run(workdir), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_unusual_script_gets_the_right_mode_and_the_same_result(workdir, case):
    mode, line = CASES[case]
    plain, _, _ = train(workdir, case, ["--no-schedule"])
    sched, run, stderr = train(workdir, case, [])
    assert {r["mode"] for r in run["ranks"]} == {mode}, stderr
    if line is not None:
        assert stderr.count(line) == 1, stderr
        assert any(line in note for note in run["ranks"][0]["notes"])
    else:
        assert "bsrun: not scheduling" not in stderr and run["ranks"][0]["partitions"] > 0
    assert_same_state(sched, plain)


def test_a_model_that_fell_back_is_still_an_instance_of_ddp(workdir):
    """Scripts test isinstance(model, DDP) with the DDP name they imported (bsrun's class)."""
    code = ("import torch, torch.distributed as dist\n"
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "dist.init_process_group('gloo')\n"
            "m = DDP(torch.nn.Linear(2, 2), find_unused_parameters=True, skip_all_reduce_unused_params=True)\n"
            "assert isinstance(m, DDP) and issubclass(type(m), DDP), type(m)\n"
            "assert not isinstance(torch.nn.Linear(2, 2), DDP)\n"
            "print('ok', type(m).__name__)\n")
    proc = run_bsrun(["-np", 2, "python", "-c", code], cwd=workdir, check=True)
    assert proc.stdout.count("ok DistributedDataParallel") == 2
