"""The row-sparse all-reduce of embedding tables (bsrun/sched/row_sparse.py).

Exact: the same script run under bsrun and under `bsrun --no-schedule` ends with the same
parameters (2 real gloo ranks, each with its own tokens), and the run summary's bytes
say whether the table really went by its rows (sparse), whole (its rows too many this
round) or was never a table (tied to an output layer). A profile records the bytes sent,
and the what-if replays the table as sent.
"""

import json

import pytest
import torch
import torch.nn as nn

from bsrun.profile import whatif
from bsrun.sched.partition import TensorInfo, plan_partitions
from bsrun.sched.row_sparse import MIN_TABLE_BYTES, embedding_tables, nonzero_rows
from conftest import WORKERS, assert_same_state, last_run, run_bsrun

SCRIPT = WORKERS / "row_sparse_train.py"


@pytest.mark.parametrize("columns", [3, 4], ids=["read-by-element", "read-by-8-bytes"])
def test_a_row_is_nonzero_by_its_bits(columns):
    """-0.0 and NaN rows are sent: only rows of +0.0 everywhere may be left out."""
    table = torch.zeros(5, columns)
    table[1, 2] = -0.0
    table[2, 0] = float("nan")
    table[3, 1] = 1e-30
    assert nonzero_rows(table).tolist() == [0, 1, 1, 1, 0]
    assert nonzero_rows(table.to(torch.bfloat16)).tolist() == [0, 1, 1, 1, 0]
    assert nonzero_rows(table.double()).tolist() == [0, 1, 1, 1, 0]


def test_only_an_embeddings_own_table_of_a_megabyte_or_more_qualifies():
    big, small = nn.Embedding(4096, 128), nn.Embedding(100, 8)
    tied, tied_out = nn.Embedding(4096, 128), nn.Linear(128, 4096)
    tied_out.weight = tied.weight
    sparse = nn.Embedding(4096, 128, sparse=True)
    modules = [big, small, tied, tied_out, sparse]
    params = [big.weight, small.weight, tied.weight, tied_out.bias, sparse.weight]
    assert big.weight.numel() * 4 >= MIN_TABLE_BYTES
    assert embedding_tables(params, modules) == [4096, 0, 0, 0, 0]


def test_a_table_is_laid_out_whole_and_alone():
    """Above the partition size it is not cut, and small neighbours are not fused into it."""
    infos = [TensorInfo(10, 4, "torch.float32"), TensorInfo(4096 * 128, 4, "torch.float32", rows=4096),
             TensorInfo(10, 4, "torch.float32")]
    parts = plan_partitions(infos, [0, 1, 2], 64 * 1024)
    assert [(p.rows, [pc.tensor for pc in p.pieces]) for p in parts] == [(0, [0]), (4096, [1]), (0, [2])]
    assert parts[1].pieces[0].stop == 4096 * 128


def run(workdir, name, script_args, bsrun_args):
    out = workdir / f"{name}.pt"
    run_bsrun([*bsrun_args, "-np", 2, "python", SCRIPT, *script_args, "--out", out],
              cwd=workdir, check=True, timeout=300)
    return torch.load(out), last_run(workdir)


CASES = {  # script arguments; the share of its dense bytes the table may send a round
    "sparse": (["--tokens", "96"], (0.0, 0.06)),  # at most 192 of 4096 rows, and the row mask
    "sparse-accumulated": (["--tokens", "48", "--accumulate", "2"], (0.0, 0.06)),
    "rows-too-many": (["--vocab", "2048", "--tokens", "4096", "--dim", "160"], (1.0, 1.01)),
    "tied": (["--tie"], (1.0, 1.0)),  # not a table: its gradient is dense
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_scheduled_with_an_embedding_equals_plain_ddp(workdir, case):
    args, (low, high) = CASES[case]
    plain, plain_run = run(workdir, "plain", args, ["--no-schedule"])
    sched, sched_run = run(workdir, "sched", args, ["--no-adapt", "--partition", "256KiB"])
    assert {r["mode"] for r in sched_run["ranks"]} == {"scheduled"}
    r0 = sched_run["ranks"][0]
    assert r0["partitions"] > r0["rounds"] > 0
    table_sent = r0["bytes"] / r0["rounds"] - (sched["grad_bytes"] - sched["table_bytes"])
    share = table_sent / sched["table_bytes"]
    assert low <= share <= high, f"the table sent {share:.4f} of its dense bytes a round, expected {low}-{high}"
    assert_same_state(sched["model"], plain["model"])
    assert_same_state(sched["optimizer"], plain["optimizer"])


@pytest.mark.slow
def test_a_profile_records_the_rows_sent_and_the_whatif_replays_them(workdir):
    folder = workdir / "prof"
    run_bsrun(["profile", "-o", folder, "--warmup", 1, "--steps", 3, "--no-adapt", "--partition", "256KiB",
               "-np", 2, "python", SCRIPT, "--steps", 8, "--out", workdir / "x.pt"], cwd=workdir, check=True, timeout=300)
    model = whatif.fit(json.loads((folder / "trace.json").read_text()))
    [table] = [p for p in model.params if "sent_bytes" in p]
    assert table["name"].endswith("embed.weight") and 0 < table["sent_bytes"] < 0.06 * table["bytes"], table
    groups, sizes, charges = whatif.layout(model, 256 * 1024, True)
    k = model.params.index(table)
    [g] = [g for g, members in enumerate(groups) if k in members]
    assert groups[g] == [k] and sizes[g] == table["sent_bytes"], "the table replays whole, as sent"
    assert charges[g] == 256 * 1024, "and holds the credit as one partition, as the scheduler charges it"
    dense_groups, dense_sizes, _ = whatif.layout(model, 256 * 1024, False)
    assert sum(dense_sizes) == sum(p["bytes"] for p in model.params), "DDP's buckets stay dense"


def test_the_bench_bound_sends_a_table_by_its_rows_as_bsrun_does(workdir):
    """The bound must stay a bound for bsrun's work: its comm sends what bsrun sends."""
    proc = run_bsrun(["--no-schedule", "-np", 2, "python", WORKERS / "bound_tables.py"], cwd=workdir, check=True)
    assert proc.stderr.count("ok ") == 2, proc.stderr
