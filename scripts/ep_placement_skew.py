"""Recorded per-rank load of 2 expert-parallel ranks under each placement on a skewed router trace (the
README's Scale out; the same scenario as tests/engine/test_ep.py).

    python scripts/ep_placement_skew.py
"""

import numpy as np

from engine.config import EngineConfig
from engine.model.maker import make_model
from engine.runner import record_router_trace, run_workload
from engine.runtime import Engine
from workloads import Request, Workload


def main():
    make_model("/tmp/ep_skew", "qwen3_moe", "tiny", seed=3, dtype="float32", router_skew=3.0,
               config_overrides={"num_experts": 16, "num_experts_per_tok": 2})
    rng = np.random.default_rng(7)
    wl = Workload("ep", [Request(f"r{i}", 0.0, int(rng.integers(4, 16)), int(rng.integers(3, 8))) for i in range(12)], {"source": "t"})
    wl = wl.with_router_trace(record_router_trace("/tmp/ep_skew", wl))
    for pl, red in (("contiguous", 0), ("hotness", 0), ("eplb", 2)):
        e = Engine("/tmp/ep_skew", EngineConfig().replace(ep_size=2, ep_placement=pl, redundant_experts=red))
        try:
            ep = run_workload(e, wl, mode="offline").meta["ep"]
        finally:
            e.close()
        print(pl, red, "tokens_per_rank", ep["tokens_per_rank"], f"imbalance_mean {ep['imbalance_mean']:.3f}",
              f"max {ep['imbalance_max']:.3f}", f"bytes_combined {ep['bytes_combined']}", "steps", len(ep["steps"]))

if __name__ == '__main__':
    main()
