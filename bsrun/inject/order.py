"""The transfer order of one model under `--order` (the policies: bsrun/sched/ordering.py).

TIC needs the dependency structure: during the first forward pass, each module that owns
parameters reports its output, and the autograd graph behind it says which parameters
that output depends on (the AccumulateGrad leaves reachable from it, counted once per
graph node thanks to a memo). TAC's order was computed by the launcher from a profile
(bsrun/profile/tac.py) and is read here as parameter names; tensors the profile does not
name go last, in forward order.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bsrun.sched import ordering


class DependencyCounter:
    """TIC's counts, gathered from module outputs during one forward pass."""

    def __init__(self, index_of: dict[int, int]):
        self.index_of = index_of                 # id(param) -> tensor index
        self.count: dict[int, int] = {}          # tensor index -> fewest dependencies of a user
        self._memo: dict[object, int] = {}       # graph node -> bitmask of reachable tensors

    def module_output(self, owned: list[int], output) -> None:
        if not torch.is_grad_enabled():
            return
        mask = 0
        for tensor in _tensors_in(output):
            if tensor.grad_fn is not None:
                mask |= self._reachable(tensor.grad_fn)
        if mask:
            n = bin(mask).count("1")
            for i in owned:
                self.count[i] = min(self.count.get(i, n), n)

    def _reachable(self, root) -> int:
        memo, stack = self._memo, [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in memo:
                continue
            children = [c for c, _ in node.next_functions if c is not None]
            if not expanded:
                stack.append((node, True))
                stack += [(c, False) for c in children if c not in memo]
                continue
            variable = getattr(node, "variable", None)  # an AccumulateGrad leaf
            mask = 1 << self.index_of[id(variable)] if variable is not None and id(variable) in self.index_of else 0
            for c in children:
                mask |= memo[c]
            memo[node] = mask
        return memo[root]

    def release(self) -> None:
        """The memo holds graph nodes alive; drop it once the order is fixed."""
        self._memo = {}


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)


def tac_order(folder: Path, names: list[str], forward: list[int]) -> list[int]:
    """The launcher's TAC order (names in FOLDER's order file) as this model's indices."""
    index = {name: i for i, name in enumerate(names)}
    ordered = json.loads((folder / ordering.TAC_ORDER_FILE).read_text())["order"]
    known = list(dict.fromkeys(index[n] for n in ordered if n in index))
    if not known:
        raise ValueError(f"the profile in {folder} is of another model (no parameter name matches)")
    placed = set(known)
    return known + [i for i in forward if i not in placed]


def transfer_order(policy: str, forward: list[int], names: list[str], counter: DependencyCounter | None) -> list[int]:
    """The tensor indices, most urgent first, under `policy` (forward, fifo, tic, tac:DIR)."""
    name, _, folder = policy.partition(":")
    if name == "fifo":
        return ordering.fifo_order(forward)
    if name == "tic":
        return ordering.tic_order(forward, counter.count if counter is not None else {})
    if name == "tac":
        return tac_order(Path(folder), names, forward)
    return forward
