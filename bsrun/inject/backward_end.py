"""The end of the whole backward pass, also when checkpointing runs backward passes inside it.

A callback queued on the autograd engine runs when the graph task that is running ends.
Reentrant `torch.utils.checkpoint` recomputes its segment and runs a backward of its own,
a nested graph task: a callback queued from a gradient hook fired in there would run when
that nested pass ends, while the outer pass still has gradients to deliver. So the callback
looks at the autograd node being run: none means the outermost task is ending; otherwise
it is the checkpoint's node, and the callback hands itself to the enclosing task by a
post-hook on that node, which runs (in the enclosing task) once the node is done. That
climbs one nesting level at a time, to the real end.
"""

from __future__ import annotations

from typing import Callable

import torch

_ENGINE = torch.autograd.Variable._execution_engine


class BackwardEnd:
    """`arm()` from a gradient hook; `on_end()` runs once, when the outermost backward ends."""

    def __init__(self, on_end: Callable[[], None]):
        self.on_end = on_end
        self.armed = False

    def arm(self) -> None:
        if not self.armed:
            self.armed = True
            _ENGINE.queue_callback(self._task_ended)

    def _task_ended(self) -> None:
        node = torch._C._current_autograd_node()
        if node is None:  # the outermost graph task
            self.armed = False
            self.on_end()
            return
        handle = []

        def enclosing_task(*_args):
            handle[0].remove()
            _ENGINE.queue_callback(self._task_ended)

        handle.append(node.register_hook(enclosing_task))
