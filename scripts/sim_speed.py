"""Speed of one simulated trial: a 1000-request synthetic workload on a built-in shape, no weights.

    python scripts/sim_speed.py [--shape qwen3-30b-a3b] [--profile builtin:h100-pcie] [--requests 1000]

Prints wall and CPU seconds per trial (median of --repeats) for the default config and a hybrid
one, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from engine.backend import make_backend
from engine.config import EngineConfig
from engine.runner import run_workload
from workloads.synth import synth_workload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--profile", default="builtin:h100-pcie")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    wl = synth_workload("speed", args.requests, seed=0)
    configs = {"default": EngineConfig(),
               "static-auto-16GiB": EngineConfig().replace(residency="static", resident_budget_gib=16,
                                                           missing_expert="auto"),
               "cache-fetch-24GiB": EngineConfig().replace(residency="cache", resident_budget_gib=24,
                                                           missing_expert="fetch")}
    out = {}
    for name, cfg in configs.items():
        b = make_backend(f"shape:{args.shape}", cfg, kind="sim", profile=args.profile)
        walls, cpus = [], []
        for _ in range(args.repeats):
            w0, c0 = time.perf_counter(), time.process_time()
            res = run_workload(b, wl, mode="offline")
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
        s = res.summary()
        out[name] = {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "steps": s["steps"],
                     "tokens": s["prompt_tokens"] + s["output_tokens"],
                     "simulated_output_tokens_per_s": s["output_tokens_per_s"]}
        print(f"{name:20s} wall {out[name]['wall_s']:.2f}s  cpu {out[name]['cpu_s']:.2f}s  steps {s['steps']}  "
              f"tokens {out[name]['tokens']}  simulated {s['output_tokens_per_s']:.0f} tok/s")
    print(json.dumps({"shape": args.shape, "profile": args.profile, "requests": args.requests, "trials": out}))


if __name__ == "__main__":
    main()
