"""bsrun: launch unmodified PyTorch data-parallel training with scheduled communication."""

__version__ = "0.1.0"


def synchronize() -> None:
    """Wait until every scheduled gradient is communicated and every update applied.

    For code that reads parameters outside the scheduled path (e.g. logging a norm right
    after `optimizer.step()`). A no-op when nothing is scheduled.
    """
    import sys

    state = sys.modules.get("bsrun.inject.state")
    if state is not None:
        state.flush_all()
