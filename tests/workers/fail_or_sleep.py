"""Rank 1 exits 3 after a moment; rank 0 (and a grandchild it starts) sleep for long.

Each process writes its pid to OUT_DIR so the test can check nothing is left behind.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
fail_rank = int(sys.argv[2]) if len(sys.argv) > 2 else 1
(out / f"pid-{rank}").write_text(str(os.getpid()))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
(out / f"grandchild-{rank}").write_text(str(child.pid))
if rank == fail_rank:
    time.sleep(1.0)
    sys.exit(3)
time.sleep(120)
