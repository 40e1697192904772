"""Writes the environment this rank sees to OUT_DIR/env-<rank>.json."""
import json
import os
import sys
from pathlib import Path

keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "OMP_NUM_THREADS", "BSRUN_ACTIVE", "BSRUN_PARTITION", "BSRUN_CREDIT", "BSRUN_ENABLE",
        "USER_SITE_RAN"]
info = {k: os.environ.get(k) for k in keys}
info["stdin_closed"] = sys.stdin is None or not sys.stdin.readable() or sys.stdin.read() == ""
info["bsrun_bootstrapped"] = "bsrun.inject.bootstrap" in sys.modules
info["argv"] = sys.argv[1:]
Path(sys.argv[1], f"env-{info['RANK']}.json").write_text(json.dumps(info))
