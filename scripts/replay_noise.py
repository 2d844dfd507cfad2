"""This machine's run-to-run noise: one config replayed at one fixed arrival rate, again and again.

    python scripts/replay_noise.py [--model builtin:qwen3_moe-small] [--workload builtin:quick]
                                   [--rate-scale 0.4] [--runs 9]

Each run replays the workload in real time with its arrival times divided by ``--rate-scale``, in
one process and one engine (nothing reloads between runs). Prints TPOT and TTFT per run and their
spread, then one JSON line. Whatever moves here moves every capacity the tuner measures.
"""

from __future__ import annotations

import argparse
import json
import statistics

from engine.backend import make_backend
from engine.config import EngineConfig
from engine.runner import run_workload
from workloads.schema import load_workload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="builtin:qwen3_moe-small")
    p.add_argument("--workload", default="builtin:quick")
    p.add_argument("--rate-scale", type=float, default=0.4)
    p.add_argument("--runs", type=int, default=9)
    args = p.parse_args()
    wl = load_workload(args.workload)
    backend = make_backend(args.model, EngineConfig(), kind="live")
    run_workload(backend, wl, mode="offline", max_requests=2)  # first-use costs, not measured
    runs = []
    for i in range(args.runs):
        s = run_workload(backend, wl, mode="realtime", rate_scale=args.rate_scale).summary()
        runs.append({k: s[k] for k in ("tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms",
                                       "output_tokens_per_s")})
        print(f"run {i + 1}: tpot p50 {s['tpot_p50_ms']:.1f} ms, p99 {s['tpot_p99_ms']:.1f} ms; "
              f"ttft p99 {s['ttft_p99_ms']:.0f} ms", flush=True)
    p50 = [r["tpot_p50_ms"] for r in runs]
    spread = (max(p50) - min(p50)) / statistics.median(p50)
    print(f"p50 TPOT {min(p50):.1f}-{max(p50):.1f} ms over {len(runs)} runs (spread {spread:.0%} of the median)")
    print(json.dumps({"model": args.model, "workload": args.workload, "rate_scale": args.rate_scale,
                      "runs": runs, "tpot_p50_spread": spread}))


if __name__ == "__main__":
    main()
