"""TicTac's timing-aware order from a profile: computed in the launcher, handed over as a file.

`write_order(folder)` fits the profile (bsrun/profile/whatif.py), makes each layer a
TAC job (its measured forward compute; its tensors' transfer times on the fitted link,
alpha + beta * bytes), orders them by Johnson's rule (bsrun/sched/ordering.py) and
writes the parameter names, most urgent first, to FOLDER/tac-order.json. The workers
read only that file (bsrun/inject/order.py), so they import nothing from the profiler
and do no fitting at their first backward pass.
"""

from __future__ import annotations

from pathlib import Path

from bsrun.fsutil import atomic_write_json
from bsrun.profile import trace, whatif
from bsrun.sched import ordering


def tac_layers(model: whatif.Model) -> list[ordering.Layer]:
    """The profiled model's layers in forward order with their measured times; tensors are
    indices into `model.params`."""
    index = {p["name"]: i for i, p in enumerate(model.params)}
    rank = model.ranks[0]
    starts = sorted((rank.forward_at[layer], layer) for layer in model.forward_layers if layer in rank.forward_at)
    layers, placed = [], set()
    for k, (start, layer) in enumerate(starts):
        end = starts[k + 1][0] if k + 1 < len(starts) else rank.forward
        tensors = [index[n] for n in model.layer_params.get(layer, []) if n in index and index[n] not in placed]
        placed.update(tensors)
        if tensors:
            layers.append(ordering.Layer(layer, max(0.0, end - start),
                                         [model.alpha + model.beta * model.params[i]["bytes"] for i in tensors],
                                         tensors))
    return layers


def write_order(folder: Path) -> Path:
    """FOLDER/tac-order.json: the profiled parameters' names, most urgent first.
    Raises ValueError when the profile cannot be fitted."""
    model = whatif.fit(trace.load(folder))
    names = [model.params[i]["name"] for i in ordering.tac_order(tac_layers(model))]
    path = Path(folder) / ordering.TAC_ORDER_FILE
    atomic_write_json(path, {"order": names})
    return path
