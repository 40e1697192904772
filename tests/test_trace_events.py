"""The profile recording's one table of kinds (bsrun/trace_events.py): the recorder writes
with it, the reader reads with it, and the recorder's modules stay on their floor."""

import ast
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bsrun import trace_events as te

BSRUN = Path(te.__file__).parent
RECORDER_MODULES = ["inject/record.py", "inject/record_hooks.py", "inject/record_ddp.py", "inject/clock.py"]
RECORDER_MAY_IMPORT = {"bsrun.config", "bsrun.fsutil", "bsrun.trace_events", "bsrun.inject",
                       *(f"bsrun.inject.{m}" for m in ("state", "ending", "import_hook", "clock", "record_hooks",
                                                       "record_ddp"))}


def imports_of(path: Path) -> list[str]:
    """Every module a file imports (`from bsrun.inject import state` gives bsrun.inject.state)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                      if node.module == "bsrun.inject"]
    return names


def test_the_format_needs_only_the_standard_library():
    for name in imports_of(BSRUN / "trace_events.py"):
        assert name.split(".")[0] in sys.stdlib_module_names or name == "__future__", name


@pytest.mark.parametrize("module", RECORDER_MODULES)
def test_the_recorder_imports_only_its_leaves(module):
    for name in imports_of(BSRUN / module):
        if name.startswith("bsrun"):
            assert name in RECORDER_MAY_IMPORT, f"{module} imports {name}"


def test_each_kind_is_its_code_then_its_fields():
    codes = [k.CODE for k in te.KINDS.values()]
    assert sorted(codes) == sorted("FBGPWYUSCDK") and all(len(c) == 1 for c in codes)
    for code, kind in te.KINDS.items():
        fields = kind._fields[1:]
        event = kind(*range(len(fields)))
        assert event.kind == code and list(event[1:]) == list(range(len(fields)))
        assert te.parse(list(event)) == event and type(te.parse(list(event))) is kind
        with pytest.raises(TypeError):
            kind(*range(len(fields) + 1))
        if code in te.FIRST_TIME:
            assert kind._fields[te.FIRST_TIME[code]].endswith("_ns")
        else:
            assert not any(f.endswith("_ns") for f in fields)
    assert te.parse(["Z", 1]) is None  # a kind this version does not know is skipped


def test_meta_lines_take_exactly_their_fields():
    assert te.meta_line(te.NOTE, text="hi") == {"meta": "note", "text": "hi"}
    with pytest.raises(ValueError):
        te.meta_line(te.END, steps=3)
    with pytest.raises(ValueError):
        te.meta_line("nonsense", text="hi")


def test_what_the_recorder_writes_the_trace_reads(tmp_path):
    """One process, no communication: a model watched, a scheduler's observer fed by hand,
    three steps; every kind it wrote comes back as its spans."""
    import torch

    from bsrun.inject.record import Recorder
    from bsrun.profile import trace

    rec = Recorder(0, tmp_path, 1, None, True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    rec.watch(model, model, None)
    params = list(model.parameters())
    pieces = [SimpleNamespace(tensor=i, start=0, stop=p.numel()) for i, p in enumerate(params)]
    rt = SimpleNamespace(params=params, partitions=[SimpleNamespace(pid=0, nbytes=232, pieces=pieces)],
                         partition_bytes=1000, credit_bytes=2000)
    observe = rec.scheduler_trace(rt)
    for step in (1, 2, 3):
        model(torch.randn(3, 4)).sum().backward()
        began = te.now()
        for event, nbytes in (("ready", 232), ("post", 232), ("finish", 100)):  # sent: fewer (row-sparse)
            observe(event, 0, te.now(), nbytes)
        rec.waited(rt, [0, 1], began - 10 ** 6)
        rec.updated(params, te.now())
        rec.on_step(step)
    rec.close()
    recording = trace.read_recordings(tmp_path)[0]
    assert {e[0] for e in recording.events} == set("FBGPWUSC")
    assert recording.clock["method"] == "single process" and recording.ended["steps"] == 3
    built = trace.build_trace([recording])
    meta = built["bsrun"]["ranks"]["0"]
    assert [layer["name"] for layer in meta["layers"]] == ["0", "2"]
    assert meta["partition_layout"] == {"0": {"partition": 1000, "credit": 2000, "sizes": [232]}}
    cats = [e.get("cat") for e in built["traceEvents"]]
    # steps 1..3 recorded (warm-up 1): two iterations of 4 module forwards, 2 layer backwards, 4 grads
    assert cats.count("step") == 3 and cats.count("forward") == 8 and cats.count("backward") == 4
    assert cats.count("grad") == 8 and cats.count("pass") == 4 and cats.count("wait") == 2
    assert cats.count("update") == 2 and cats.count("transfer") == 2
    transfer = next(e for e in built["traceEvents"] if e.get("cat") == "transfer")
    assert transfer["args"]["round"] == 2 and transfer["args"]["pieces"][0] == ["0.weight", 128]
    assert transfer["args"]["bytes"] == 100, "a transfer's bytes are those its collective sent"
