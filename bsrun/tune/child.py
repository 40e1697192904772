"""`python -m bsrun.tune.child PARENT_PID ARGS...`: bsrun's command line for one trial,
ended with SIGTERM when the `bsrun tune` that started it dies, even by SIGKILL.

The trial's bsrun asks the kernel for that signal itself (PR_SET_PDEATHSIG on Linux),
so the tuner needs no `preexec_fn` (unsafe in a process with threads). SIGTERM makes
bsrun stop its workers and remove its emulated network as on any stop, so a killed
tuner leaves no launch running behind it.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main() -> None:
    parent, args = int(sys.argv[1]), sys.argv[2:]
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the tuner still stops its trial on SIGINT/SIGTERM
    if os.getppid() != parent:
        sys.exit(128 + signal.SIGTERM)  # the tuner died before we could ask
    from bsrun.cli import main as bsrun_main

    bsrun_main(args)


if __name__ == "__main__":
    main()
