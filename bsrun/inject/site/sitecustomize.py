"""bsrun's sitecustomize: first on PYTHONPATH of every process a bsrun launch starts.

It installs bsrun's bootstrap when BSRUN_ACTIVE=1, then runs the sitecustomize that
would have run without bsrun (the next one on sys.path), so users keep theirs.
"""

import os
import sys


def _start_bsrun():
    try:
        from bsrun.inject import bootstrap
    except ImportError:
        root = os.environ.get("BSRUN_PACKAGE_ROOT")
        if not root:
            raise
        sys.path.append(root)
        from bsrun.inject import bootstrap
    bootstrap.start()


def _chain_user_sitecustomize():
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if os.environ.get("BSRUN_ACTIVE") == "1":
    try:
        _start_bsrun()
    except Exception as e:  # never break the user's process because of bsrun
        print(f"bsrun: warning: bootstrap failed, running unscheduled: {e!r}", file=sys.stderr)
_chain_user_sitecustomize()
