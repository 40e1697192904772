"""Ending the job at one optimizer step on every rank (tuning trials, `bsrun profile --steps`).

At the end step every rank:
1. finishes its scheduled communication and applies every pending update;
2. waits for the others (`dist.barrier()` where torch.distributed is initialised,
   `hvd.barrier()` under Horovod), so no rank leaves while another is still in a
   collective, and rank 0, which hosts the rendezvous store, leaves last or together;
3. runs the caller's last words (rank 0 writes a trial's measurement, the recorder closes);
4. raises SystemExit(0) out of `optimizer.step()`.

Why SystemExit and not `os._exit`: the script's `finally` blocks and atexit handlers
still run (`destroy_process_group`, DataLoader workers, bsrun's own run report), code
after the training loop (a final evaluation, saving a checkpoint over the real one)
does not, and the launcher sees exit code 0 on every rank. A script may swallow
SystemExit (a bare `except:` around its loop), so a process still alive EXIT_GRACE_S
after the end writes its run report and leaves with `os._exit(0)` (`hard_exit`).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable

from bsrun.inject import report, state

EXIT_GRACE_S = 30.0  # after the end step, a process still alive is ended


def barrier() -> None:
    """Every rank of the job meets here (the training thread's collective)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        return
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None and hvd.is_initialized():
        hvd.barrier()


def hard_exit(rank: int) -> None:
    """Leave now, with the run report written: for a script that went on after the end."""
    report.write_rank_report(rank)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def end_job(rank: int, last_words: Callable[[], None] | None = None) -> None:
    """Steps 1-4 above; raises SystemExit(0)."""
    state.flush_all()
    barrier()
    if last_words is not None:
        last_words()
    watchdog = threading.Timer(EXIT_GRACE_S, hard_exit, args=(rank,))
    watchdog.daemon = True
    watchdog.start()
    raise SystemExit(0)
