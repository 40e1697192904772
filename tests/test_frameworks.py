"""Frameworks (issue 16): HF Trainer, Accelerate and Lightning scripts, written against the
real packages, run under bsrun exactly as their users launch them, on 2 gloo ranks.

Each case runs one command twice: as it is (the reference: no bsrun anywhere) and with
`bsrun` in front (small partitions, 4KiB, credit 2x, so that tensors are cut and their
communication overlaps), compares rank 0's saved final parameters with allclose (float32,
rtol 1e-5), and asserts from `.bsrun/last-run.json` that both ranks ran "scheduled" with
partitions > 0, so that the comparison is not against a fallback to plain DDP.

What each framework does to the DDP model, the optimizer and the environment (read from
the installed sources: transformers 5.24, accelerate 1.16, lightning 2.6.6):

- HF Trainer (through Accelerate): `DistributedDataParallel(model, find_unused_parameters=
  True)` for a PreTrainedModel without gradient checkpointing (`ddp_find_unused_parameters`
  unset), `accelerator.no_sync(model)` -> `model.no_sync()` for all but the last
  micro-batch of an accumulation, `clip_grad_norm_` every step (max_grad_norm 1.0),
  `optimizer.step()` without a closure, `model.zero_grad()`.
- Accelerate: `DistributedDataParallel(model, **DistributedDataParallelKwargs non-defaults)`,
  `accumulate()`/`no_sync()` -> `model.no_sync()`, `unwrap_model` -> `model.module`.
  `accelerate launch --cpu --num_processes 2` starts ONE process (its simple launcher needs
  mpirun for more); `--multi_gpu --num_processes 2` runs torchrun's agent inside the
  accelerate process (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*), and
  `Accelerator(cpu=True)` then trains MULTI_CPU over gloo. Its default port is a fixed
  29500, so the tests give `--main_process_port`.
- Lightning (DDPStrategy): `DistributedDataParallel(module=LightningModule, device_ids=None)`,
  the forward redirected through it (`training_step` as the wrapped module's forward);
  automatic optimisation: `optimizer.step(closure=...)` whose closure runs zero_grad,
  training_step and backward, `model.no_sync()` for accumulation; manual optimisation:
  `model.require_backward_grad_sync` set False after the inner forward and True after the
  outer one, then in manual_backward `prepare_for_backward`: `model.require_backward_grad_sync`,
  `model.require_forward_param_sync`, `model.find_unused_parameters`, `model.static_graph`,
  `model.reducer._rebuild_buckets()`, `model.reducer.prepare_for_backward(...)`; post_backward
  reads `model.static_graph` (and `model.reducer._delay_all_reduce()` when it is True);
  teardown reads `model.static_graph` and `model._get_ddp_logging_data()`. Every step it also
  broadcasts a SIGTERM flag tensor on the default group. Its own launcher (`python
  train.py`, no LOCAL_RANK in the environment) re-runs `sys.executable argv[0] argv[1:]` for
  ranks 1.. with LOCAL_RANK, NODE_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (a free port
  unless set) in an environment copied from rank 0's; LOCAL_RANK in the environment means
  "launched externally" (LightningEnvironment); under torchrun it uses TorchElasticEnvironment
  (RANK, LOCAL_RANK, WORLD_SIZE required, WORLD_SIZE must equal devices * num_nodes).

Observed (a __getattribute__/__setattr__ spy on plain DDP, these scripts, outside torch):
Trainer: train(), zero_grad(), parameters(), and Accelerate's no_sync() with accumulation;
Accelerate: sets _is_accelerate_prepared, no_sync(), module/modules()/_modules (unwrap_model);
Lightning automatic: static_graph and _get_ddp_logging_data() at teardown only; Lightning
manual: require_backward_grad_sync (set and read), require_forward_param_sync (set),
find_unused_parameters, static_graph, reducer (_rebuild_buckets(), prepare_for_backward()).
"""

import json
import os
import shutil
import socket
import sys

import pytest
import torch

from conftest import WORKERS, assert_same_state, assert_scheduled, bsrun_env, last_run, run_as_group, run_bsrun

SCHED = ["--partition", "4KiB", "--credit", "2x", "--timeout", "60"]
TORCHRUN = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
ACCELERATE = shutil.which("accelerate") or os.path.join(os.path.dirname(sys.executable), "accelerate")
# No launcher variables from the test's own environment: each launcher sets its own.
CLEAN = {k: None for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                           "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED", "TORCHELASTIC_RUN_ID")}


def env():
    return bsrun_env(**CLEAN)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(proc) -> str:
    return f"--- stdout (tail)\n{proc.stdout[-2000:]}\n--- stderr (tail)\n{proc.stderr[-4000:]}"


def reference(workdir, command, out, timeout):
    """The command exactly as users run it, without bsrun; rank 0's saved state."""
    proc = run_as_group([*command, "--out", out], timeout, cwd=workdir, env=env())
    assert proc.returncode == 0, f"the reference run (no bsrun) exited {proc.returncode}\n{tail(proc)}"
    assert out.exists(), f"the reference run saved nothing\n{tail(proc)}"
    return torch.load(out)


def scheduled(workdir, command, out, timeout, sched_args=SCHED):
    """`bsrun SCHED command`; rank 0's saved state and the run summary."""
    proc = run_bsrun([*sched_args, *command, "--out", out], cwd=workdir, env=env(), timeout=timeout)
    assert proc.returncode == 0, f"bsrun ... exited {proc.returncode}\n{tail(proc)}"
    assert out.exists(), f"the bsrun run saved nothing\n{tail(proc)}"
    return torch.load(out), last_run(workdir), proc


def same_as_without_bsrun(workdir, command, timeout=180, per_run=None, sched_args=SCHED):
    """command(port) -> argv; runs the reference, then bsrun; compares; returns bsrun's proc."""
    plain = reference(workdir, command(free_port()), workdir / "plain.pt", timeout)
    sched, run, proc = scheduled(workdir, command(free_port()), workdir / "sched.pt", timeout, sched_args)
    assert_scheduled(run, context=tail(proc))
    try:
        assert_same_state(sched, plain)
    except AssertionError as e:
        raise AssertionError(f"bsrun's parameters differ from the run without bsrun: {e}") from None
    return proc


def torchrun(script, *args):
    return lambda port: [TORCHRUN, "--nproc-per-node", 2, "--master-addr", "127.0.0.1", "--master-port", port,
                         WORKERS / script, *args]


# --- 1-2. Hugging Face Trainer under torchrun ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2], ids=["no-accumulation", "gradient_accumulation_steps=2"])
def test_hf_trainer_with_its_default_find_unused_parameters(workdir, accum):
    """`bsrun torchrun --nproc-per-node 2` of a Trainer script: BERT for sequence
    classification from a tiny BertConfig, 4 optimizer steps, ddp_find_unused_parameters left
    to the Trainer, which then passes find_unused_parameters=True (no gradient
    checkpointing); with gradient_accumulation_steps=2 the first micro-batch of each step
    runs under no_sync()."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[test])")
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e .[test])")
    same_as_without_bsrun(workdir, torchrun("fw_hf_trainer.py", "--accum", accum, "--workdir",
                                            workdir / "trainer"))


# --- 3. Accelerate under accelerate launch ----------------------------------------------------------


@pytest.mark.slow
def test_accelerate_loop_under_accelerate_launch(workdir):
    """`bsrun accelerate launch --multi_gpu --num_processes 2 ...` of an Accelerate loop with
    gradient accumulation 2 (accumulate() -> no_sync()), AdamW, 6 steps, on CPU (see the
    module docstring for why --multi_gpu, not --cpu, starts 2 CPU processes)."""
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e .[test])")

    def command(port):
        return [ACCELERATE, "launch", "--multi_gpu", "--num_processes", 2, "--num_machines", 1,
                "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", port,
                WORKERS / "fw_accelerate.py"]

    same_as_without_bsrun(workdir, command)


# --- 4-7. Lightning: its own launcher and torchrun, automatic and manual optimisation -----------------

LIGHTNING_CASES = {
    "automatic-own-launcher": ("python", []),
    "manual-own-launcher": ("python", ["--manual"]),
    "automatic-torchrun": ("torchrun", []),
    "manual-torchrun": ("torchrun", ["--manual"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", LIGHTNING_CASES)
def test_lightning_ddp_strategy(workdir, case):
    """`Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=6, deterministic=True)`
    on a small MLP, SGD with momentum. own-launcher: `bsrun python fw_lightning.py`, where
    Lightning's subprocess launcher re-runs the script for rank 1; torchrun: `bsrun torchrun
    --nproc-per-node 2 fw_lightning.py` (Lightning detects torchrun and launches nothing).
    automatic: optimizer.step(closure) with the training step and backward inside the
    closure; manual: self.manual_backward(loss), opt.step()."""
    pytest.importorskip("lightning", reason="lightning is not installed (pip install -e .[test])")
    launcher, args = LIGHTNING_CASES[case]
    if launcher == "python":
        command = lambda port: [sys.executable, WORKERS / "fw_lightning.py", *args]  # noqa: E731
    else:
        command = torchrun("fw_lightning.py", *args)
    same_as_without_bsrun(workdir, command)


@pytest.mark.slow
def test_lightning_adapts_through_ddps_own_reducer(workdir):
    """The automatic-optimisation Lightning script under torchrun for 16 steps with every
    knob bsrun's default, so adaptation's search reaches the unscheduled-like point, which
    runs on DDP's own reducer (optimizer.step(closure): the closure's forward through the
    genuine DDP, the optimizer's own step) for at least a whole window: the same
    parameters as without bsrun, and the summary shows the switch and the DDP rounds."""
    pytest.importorskip("lightning", reason="lightning is not installed (pip install -e .[test])")
    same_as_without_bsrun(workdir, torchrun("fw_lightning.py", "--steps", 16), sched_args=["--timeout", "60"])
    run = last_run(workdir)
    switches = run["ranks"][0]["adapt"]["switches"]
    assert any(s["ddp_reducer"] for s in switches), f"no switch ran on DDP's reducer: {switches}"
    assert all(r["ddp_rounds"] >= 4 for r in run["ranks"]), [r["ddp_rounds"] for r in run["ranks"]]


# --- 8. bsrun profile of a Lightning script ---------------------------------------------------------------


@pytest.mark.slow
def test_profile_of_a_lightning_script_records_per_layer_forward_waits(workdir):
    """`bsrun profile` of the automatic-optimisation Lightning script under its own launcher
    (a wider MLP, 256 hidden, so that communication outlasts the step; 2 warm-up and 6
    recorded steps; 4KiB partitions): both ranks are recorded, scheduled, and the training
    thread's waits for communication between the recorded steps are the dependency proxy's
    forward waits, each for the parameters of one layer, for more than one layer; none is a
    wait for the whole model, and no rank says it synchronises fully. Lightning's automatic
    optimisation steps with `optimizer.step(closure)`, so this is the closure path at full
    overlap. The wait after the last recorded step is left out: there the profiler ends the
    job and every rank finishes its communication at once (bsrun/inject/ending.py)."""
    pytest.importorskip("lightning", reason="lightning is not installed (pip install -e .[test])")
    folder = workdir / "prof"
    proc = run_bsrun(["profile", "-o", folder, "--warmup", 2, "--steps", 6, *SCHED, sys.executable,
                      WORKERS / "fw_lightning.py", "--width", 256, "--steps", 12, "--out", workdir / "prof.pt"],
                     cwd=workdir, env=env(), timeout=180)
    assert proc.returncode == 0, f"bsrun profile exited {proc.returncode}\n{tail(proc)}"
    trace = json.loads((folder / "trace.json").read_text())
    summary = json.loads((folder / "summary.json").read_text())
    assert trace["distributedInfo"]["world_size"] == 2 and summary["scheduled"], summary
    layer_of = {p: layer["name"] for layer in trace["bsrun"]["ranks"]["0"]["layers"] for p in layer["params"]}
    assert set(layer_of.values()) == {"net.0", "net.2", "net.4"}, layer_of
    for rank in (0, 1):
        last_step = max(e["ts"] for e in trace["traceEvents"] if e.get("pid") == rank and e.get("cat") == "step")
        waits = [e for e in trace["traceEvents"] if e.get("pid") == rank and e.get("cat") == "wait"
                 and e.get("ph") == "X" and e["args"].get("params") and e["ts"] < last_step]
        layers = [sorted({layer_of[p] for p in e["args"]["params"]}) for e in waits]
        whole = [(round(e["ts"]), round(e["dur"]), names) for e, names in zip(waits, layers) if len(names) > 1]
        assert not whole, (f"rank {rank} waited for the communication of several layers at once (ts us, "
                           f"dur us, layers): {whole}")
        assert len({names[0] for names in layers}) > 1, \
            f"rank {rank}: no per-layer forward waits were recorded: {layers}\n{tail(proc)}"
    full = [n for n in summary.get("notes", []) if "synchronising fully" in n]
    assert not full and "synchronising fully" not in proc.stderr, \
        f"a rank synchronised fully: {full}\n{tail(proc)}"
