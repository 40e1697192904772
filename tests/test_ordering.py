"""--order: TicTac's TIC (dependency counts from the autograd graph) and TAC (Johnson's rule
on measured times) beside the forward order; every order gives plain DDP's parameters."""

import pytest
import torch

from bsrun.inject.order import DependencyCounter, transfer_order
from bsrun.sched.ordering import Layer, fifo_order, tac_order, tic_order
from conftest import WORKERS, assert_same_state, run_bsrun
from test_equivalence import CASES, train


class Branchy(torch.nn.Module):
    """x -> a1 -> a2 -> a3 -> head, and a side branch x -> b -> head, used after a3."""

    def __init__(self):
        super().__init__()
        self.a1, self.a2, self.a3 = (torch.nn.Linear(4, 4) for _ in range(3))
        self.b = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        deep = self.a3(self.a2(self.a1(x)))
        return self.head(torch.cat([deep, self.b(x)], dim=1))


def tic_of(model):
    params = [p for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    index = {id(p): i for i, p in enumerate(params)}
    counter = DependencyCounter(index)
    for module in model.modules():
        owned = [index[id(p)] for p in module._parameters.values() if p is not None]
        if owned:
            module.register_forward_hook(lambda _m, _i, out, owned=owned: counter.module_output(owned, out))
    model(torch.randn(2, 4))
    forward = list(range(len(params)))  # registration order is the first-use order here but for b
    return [names[i] for i in transfer_order("tic", forward, names, counter)], counter


def test_tic_counts_the_transfers_each_operation_waits_for():
    order, counter = tic_of(Branchy())
    by_name = dict(zip([n for n, _ in Branchy().named_parameters()], range(10)))
    assert counter.count[by_name["a1.weight"]] == 2 and counter.count[by_name["b.weight"]] == 2
    assert counter.count[by_name["a3.bias"]] == 6 and counter.count[by_name["head.weight"]] == 10
    # b unlocks an operation after 2 transfers, as a1 does: it goes before a2 and a3
    assert order == ["a1.weight", "a1.bias", "b.weight", "b.bias", "a2.weight", "a2.bias",
                     "a3.weight", "a3.bias", "head.weight", "head.bias"]


def test_tic_ignores_passes_without_gradients_and_keeps_unseen_tensors_last():
    model = Branchy()
    params = list(model.parameters())
    counter = DependencyCounter({id(p): i for i, p in enumerate(params)})
    with torch.no_grad():
        counter.module_output([0, 1], model.a1(torch.randn(2, 4)))
    assert counter.count == {}
    assert tic_order([3, 1, 2], {2: 1}) == [2, 3, 1]
    assert fifo_order([0, 1, 2]) == [2, 1, 0]


def test_tac_puts_a_layer_that_unlocks_long_compute_with_little_communication_first():
    heavy_comm = Layer("embedding", compute_s=0.001, transfer_s=[1.0], tensors=[0])
    heavy_compute = Layer("conv", compute_s=1.0, transfer_s=[0.005, 0.005], tensors=[1, 2])
    # Johnson: conv before embedding, as min(P_emb, M_conv) = 0.001 < min(P_conv, M_emb) = 1.0
    assert tac_order([heavy_comm, heavy_compute]) == [1, 2, 0]
    alike = [Layer(f"l{k}", 0.01, [0.01], [k]) for k in range(4)]
    assert tac_order(alike) == [0, 1, 2, 3], "equal layers keep the forward order"


ORDERS = [("allreduce", "tic"), ("allreduce", "fifo"), ("ps", "tic"), ("ps", "tac")]


@pytest.mark.slow
@pytest.mark.parametrize("arch,order", ORDERS, ids=[f"{a}-{o}" for a, o in ORDERS])
def test_every_order_gives_the_parameters_of_plain_ddp(workdir, arch, order):
    args = CASES["rmsprop-batchnorm"]
    if order == "tac":  # TAC orders by a profile of this job
        run_bsrun(["profile", "-o", workdir / "prof", "-np", 2, "python", WORKERS / "train_equiv.py", *args,
                   "--out", workdir / "p.pt"], cwd=workdir, check=True, timeout=300)
        order = f"tac:{workdir / 'prof'}"
    plain, _ = train(workdir, "plain", args, ["--no-schedule"])
    ordered, run = train(workdir, "ordered", args, ["--arch", arch, "--order", order, "--partition", "1KiB"])
    assert run["config"]["order"] == order and [r["mode"] for r in run["ranks"]] == ["scheduled"] * 2
    assert_same_state(ordered, plain)


def test_tac_without_a_profile_ends_in_one_line(workdir):
    proc = run_bsrun(["--order", "tac", "-np", 2, "python", WORKERS / "train_equiv.py", "--out", "x.pt"], cwd=workdir)
    assert proc.returncode == 2 and "no profile in .bsrun/profile" in proc.stderr, proc.stderr
    proc = run_bsrun(["--order", "tac:nowhere", "-np", 2, "python", WORKERS / "train_equiv.py", "--out", "x.pt"],
                     cwd=workdir)
    assert proc.returncode == 2 and "no trace.json in nowhere" in proc.stderr, proc.stderr
