"""Three tuner workers against one on a 12-trial study (a throwaway PostgreSQL server); the README's Scale out.

    python scripts/workers_bench.py
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna

from db.testing import create_database, start_postgres
from tuner.study import counted_trials

FAST = ["--model", "builtin:qwen3_moe-tiny", "--workload", "builtin:tiny", "--mode", "offline", "--max-requests", "6", "--no-quality", "--quiet"]
env = {**os.environ, "OMP_NUM_THREADS": "1"}
url, stop = start_postgres(Path(tempfile.mkdtemp()))
try:
    def tun(args):
        return subprocess.Popen([sys.executable, "-m", "tuner.cli", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    res = {}
    # one worker: the study's first run does 1 trial, then one worker does the other 11
    for n in (1, 3):
        u = create_database(url)
        p = tun(["run", *FAST, "--trials", "1", "--db", u, "--study", f"m{n}"])
        p.communicate()
        assert p.returncode == 0
        (name,) = optuna.get_all_study_names(u)
        t = time.monotonic()
        ps = [tun(["worker", "--db", u, "--study", name, "--trials", "12", "--quiet"]) for _ in range(n)]
        for q in ps:
            o, e = q.communicate()
            assert q.returncode == 0, e
        wall = time.monotonic() - t
        tr = optuna.load_study(study_name=name, storage=u).get_trials(deepcopy=False)
        res[n] = {"workers": n, "wall_s": round(wall, 1), "counted": len(counted_trials(tr)), "trials": len(tr),
                  "states": {s: [t.state.name for t in tr].count(s) for s in ("COMPLETE", "PRUNED", "FAIL")}}
        print(res[n], flush=True)
    print(json.dumps(res))
finally:
    stop()
