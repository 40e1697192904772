"""Transfer orderings: which gradient tensor is most urgent (becomes partition 0, 1, ...).

- forward: first use in the next forward pass (ByteScheduler). The caller has it.
- fifo: the reverse, roughly the order gradients become ready (an unscheduled PS's order).
- tic: TicTac's timing-independent order. Every transfer costs 1 and computation 0; an
  operation can run once every transfer it depends on, directly or through its inputs, is
  done; a tensor's priority is the smallest such count over the operations that use it,
  so the transfers that unlock an operation soonest go first (ties: forward order).
- tac: TicTac's timing-aware order, from measured times: layers compete as two-machine
  jobs (network, then compute) by Johnson's rule: A goes before B if
  min(P_B, M_A) < min(P_A, M_B), with M a layer's outstanding communication time (its
  own transfers and those of every layer it waits for, as one training thread runs the
  layers in forward order) and P its compute time. The best by that rule is taken, its
  transfers leave the outstanding set, and the rest are compared again.

Pure functions of their inputs: no torch, no timing. TAC's order is computed once, in
the launcher, from a profile (bsrun/profile/tac.py), and reaches the workers as the
parameter names in TAC_ORDER_FILE inside the profile's folder.
"""

from __future__ import annotations

from dataclasses import dataclass

TAC_ORDER_FILE = "tac-order.json"  # {"order": [parameter name, ...]}, most urgent first


def fifo_order(forward: list[int]) -> list[int]:
    return list(reversed(forward))


def tic_order(forward: list[int], dependency_count: dict[int, int]) -> list[int]:
    """`dependency_count[i]`: the fewest transfers an operation using tensor i waits for;
    a tensor without one (not seen in the graph) goes last, in forward order."""
    position = {t: k for k, t in enumerate(forward)}
    unknown = max(dependency_count.values(), default=0) + 1
    return sorted(forward, key=lambda t: (dependency_count.get(t, unknown), position[t]))


@dataclass(frozen=True)
class Layer:
    name: str
    compute_s: float            # P: its forward compute
    transfer_s: list[float]     # each of its tensors' transfer time
    tensors: list[int]          # those tensors, in the layer's own order


def tac_order(layers: list[Layer]) -> list[int]:
    """`layers` in forward (execution) order; returns the tensors, most urgent first."""
    totals = [sum(layer.transfer_s) for layer in layers]
    outstanding = list(range(len(layers)))
    order: list[int] = []
    while outstanding:
        comm, running = {}, 0.0  # M: what must arrive before layer k can run
        for k in outstanding:
            running += totals[k]
            comm[k] = running
        best = outstanding[0]
        for k in outstanding[1:]:
            if min(layers[best].compute_s, comm[k]) < min(layers[k].compute_s, comm[best]):
                best = k  # Johnson's rule: k before best
        order += layers[best].tensors
        outstanding.remove(best)
    return order
