"""One set of decisions, three backends: the live engine, the stub and the simulator make the same plans.

A live run of the tiny model records its router trace; the stub backend and the simulator (priced
by a host-only datasheet profile, on a virtual clock) run the same workload with no tensors, taking
each token's experts from that trace. Both must write identical decision
logs (every step, MoE layer and micro-batch: which experts ran resident and in which precision, on
the host or fetched, how replicas split tokens, what the cache did, what moved between tiers), the
same tier statistics, expert table and step shapes, for every residency policy, host/fetch/auto,
replicas, micro-batching and routing pruning. The stub also runs with torch unimportable.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from engine.backend import make_backend
from engine.config import EngineConfig
from engine.moe.policy import CostModel
from engine.runner import record_router_trace, run_workload
from workloads import Request, Workload
from workloads.router import RouterTrace

EXPERT_BYTES = 3 * 64 * 32 * 4  # one tiny fp32 expert (hidden 64, width 32)
BUDGET_GIB = 6 * EXPERT_BYTES * 2 / 2**30  # room for 6 of 16 experts in each of the 2 MoE layers

# Host compute costs more per token than a fetch plus fast compute beyond a few tokens: auto then
# runs small experts on the host and fetches busy ones.
COSTS = CostModel.from_measurements({
    "default_precision": "fp32",
    "link": {"bandwidth_bytes_per_s": 2.5e9, "latency_s": 0.0},
    "host": {"fp32": {"overhead_s": 1e-5, "weight_s_per_byte": 1e-10, "token_s_per_byte": 1e-10}},
    "device": {"fp32": {"overhead_s": 1e-5, "weight_s_per_byte": 1e-11, "token_s_per_byte": 1e-12}},
})

CASES = {
    "plain": {},
    "static-host": dict(residency="static", resident_budget_gib=BUDGET_GIB, missing_expert="host"),
    "static-fetch": dict(residency="static", resident_budget_gib=BUDGET_GIB, missing_expert="fetch",
                         budget_split="proportional"),
    "static-auto": dict(residency="static", resident_budget_gib=BUDGET_GIB, missing_expert="auto"),
    "static-lo-int8": dict(residency="static", resident_budget_gib=BUDGET_GIB * 1.25, lo_precision="int8",
                           missing_expert="host"),
    "dynamic": dict(residency="dynamic", resident_budget_gib=BUDGET_GIB / 2, dynamic_replan_tokens=4,
                    dynamic_halflife_tokens=8, dynamic_hysteresis=0.0, missing_expert="host"),
    "dynamic-1-swap": dict(residency="dynamic", resident_budget_gib=BUDGET_GIB / 2, dynamic_replan_tokens=4,
                           dynamic_halflife_tokens=8, dynamic_hysteresis=0.0, dynamic_max_swaps_per_replan=1,
                           missing_expert="fetch"),
    "cache-lru-prefetch": dict(residency="cache", resident_budget_gib=BUDGET_GIB, prefetch_experts=2,
                               missing_expert="host"),
    "cache-lfu-small": dict(residency="cache", resident_budget_gib=BUDGET_GIB / 3, cache_policy="lfu",
                            missing_expert="fetch"),
    "replicas": dict(max_replicas=2, replica_threshold=1.1, replica_window_tokens=4),
    "replicas-static": dict(max_replicas=1, replica_threshold=1.5, replica_window_tokens=8, residency="static",
                            resident_budget_gib=BUDGET_GIB * 2, missing_expert="host"),
    "micro": dict(expert_batching="micro", micro_batch_tokens=3),
    "micro-cache": dict(expert_batching="micro", micro_batch_tokens=2, residency="cache",
                        resident_budget_gib=BUDGET_GIB, missing_expert="auto"),
    "top-k-override": dict(top_k_override=2, residency="static", resident_budget_gib=BUDGET_GIB,
                           missing_expert="host"),
}


def _workload() -> Workload:
    rng = np.random.default_rng(1)
    reqs = [Request(f"r{i}", 0.0, int(rng.integers(3, 14)), int(rng.integers(2, 6))) for i in range(7)]
    return Workload("parity", reqs, {"source": "test"})


@pytest.fixture(scope="module")
def model_dir(make_ckpt):
    return str(make_ckpt("qwen2_moe", seed=4, experts=16, top_k=4, width=32))


@pytest.fixture(scope="module")
def workload(model_dir):
    wl = _workload()
    base = EngineConfig().replace(compute_dtype="float32")
    return wl.with_router_trace(record_router_trace(model_dir, wl, base))


def _config(knobs: dict) -> EngineConfig:
    # Small batches, so prompts prefill in chunks next to decoding sequences.
    return EngineConfig().replace(compute_dtype="float32", max_batch_seqs=3, max_batch_tokens=24,
                                  prefill_chunk_tokens=5, **knobs)


def _live_trace(result, live) -> RouterTrace:
    routes = result.meta["routes"]
    keys = [k for k in routes]
    return RouterTrace.from_arrays(request_ids=keys, expert_ids=[routes[k][0] for k in keys],
                                   gate_weights=[routes[k][1] for k in keys], model_identity=live.model_identity())


def _shape(result) -> dict:
    return {"steps": [(s.batch_seqs, s.prefill_tokens, s.decode_tokens) for s in result.steps],
            "outputs": [r.output_tokens for r in result.requests],
            "experts": [(e.layer, e.expert, e.tokens, e.resident, e.precision, e.replicas) for e in result.expert_stats],
            "tiers": result.meta["tiers"], "fast_bytes": result.meta["fast_tier_expert_bytes"]}


def _untimed(entry: dict) -> dict:
    """A decision without timing fields (none are logged today; a priced backend may add some)."""
    return {k: v for k, v in entry.items() if not k.endswith(("_s", "_ms"))}


@pytest.mark.parametrize("case", list(CASES))
def test_live_stub_and_sim_make_the_same_decisions(model_dir, workload, case):
    cfg = _config(CASES[case])
    live = make_backend(model_dir, cfg, cost_model=COSTS)
    got_live = run_workload(live, workload, mode="offline", record_routes=True, decisions=True)
    trace = _live_trace(got_live, live)
    stub = make_backend(model_dir, cfg, kind="stub", trace=trace, cost_model=COSTS)
    got_stub = run_workload(stub, workload, mode="offline", decisions=True)
    sim = make_backend(model_dir, cfg, kind="sim", profile="builtin:spr", trace=trace, cost_model=COSTS)
    got_sim = run_workload(sim, workload, mode="offline", decisions=True)
    assert got_stub.meta["backend"] == "stub" and got_live.meta["backend"] == "live"
    assert got_sim.meta["backend"] == "sim" and got_sim.meta["calibrated"] is False
    assert got_live.decisions, "the live run kept no decisions"
    for other, got in (("stub", got_stub), ("sim", got_sim)):
        for i, (a, b) in enumerate(zip(got_live.decisions, got.decisions, strict=False)):
            assert _untimed(a) == _untimed(b), f"decision {i} differs:\n live {a}\n {other} {b}"
        assert len(got_live.decisions) == len(got.decisions)
        assert _shape(got_live) == _shape(got)
    # The simulator priced every step; the stub priced none.
    assert all(s.duration_ms > 0 for s in got_sim.steps) and got_sim.duration_s > 0
    assert got_sim.meta["priced"] is True and got_stub.meta["priced"] is False
    # The premise: the live run's routing is the one recorded with the default config.
    wl_ids = workload.router_trace.request("r0")[0]
    live_ids = got_live.meta["routes"]["r0"][0]
    np.testing.assert_array_equal(np.sort(wl_ids, -1), np.sort(live_ids, -1))


def _wheres(decisions) -> set[str]:
    return {w for d in decisions for p in d.get("parts", ()) for w in ("hi", "lo", "host", "fetch") if w in p}


def test_the_cases_exercise_what_they_name(model_dir, workload):
    """Each case's log shows its mechanism (so parity above is not parity of empty logs)."""
    def decisions(case: str) -> list[dict]:
        stub = make_backend(model_dir, _config(CASES[case]), kind="stub", cost_model=COSTS)
        return run_workload(stub, workload, mode="offline", decisions=True).decisions

    assert _wheres(decisions("static-host")) == {"hi", "host"}
    assert _wheres(decisions("static-fetch")) == {"hi", "fetch"}
    assert _wheres(decisions("static-auto")) == {"hi", "host", "fetch"}
    assert "lo" in _wheres(decisions("static-lo-int8"))
    dyn = decisions("dynamic")
    assert any("promote" in d.get("moves", {}) for d in dyn)
    one = [d["moves"] for d in decisions("dynamic-1-swap") if "promote" in d.get("moves", {})]
    assert one and all(len([m for m in mv["promote"] if m[0] == layer]) <= 1 for mv in one for layer in (0, 1))
    cache = decisions("cache-lru-prefetch")
    assert any("prefetch" in d for d in cache) and any("evict" in p for d in cache for p in d.get("parts", ()))
    assert any("split" in p for d in decisions("replicas") for p in d.get("parts", ()))
    assert any(len(d.get("parts", ())) > 1 for d in decisions("micro"))
    # The initial placement comes first: static keeps 6 experts per layer resident.
    assert [len(h) for h in decisions("static-host")[0]["hi"]] == [6, 6]


def test_the_cache_is_accessed_once_per_micro_batch_with_its_experts_pinned(model_dir, workload):
    """A cache smaller than one step's experts admits what fits and evicts none of the same access."""
    stub = make_backend(model_dir, _config(CASES["cache-lfu-small"]), kind="stub")
    for d in run_workload(stub, workload, mode="offline", decisions=True).decisions:
        for p in d.get("parts", ()):
            routed = {e for w in ("hi", "host", "fetch") for e, _n in p.get(w, ())}
            assert not set(p.get("evict", ())) & routed  # nothing this access needs is evicted by it
            assert set(p.get("admit", ())) <= set(p.get("miss", ()))
            assert {e for e, _n in p.get("hi", ())} == set(p.get("hit", ())) | set(p.get("admit", ()))


def test_virtual_clock_jumps_to_arrivals_without_sleeping(model_dir, workload):
    far = Workload("far", [Request(r.request_id, 600.0 * i, r.prompt_len, r.max_new_tokens)
                           for i, r in enumerate(workload.requests)], {}).with_router_trace(workload.router_trace)
    stub = make_backend(model_dir, _config({}), kind="stub")
    import time

    t = time.perf_counter()
    res = run_workload(stub, far, mode="realtime")
    assert time.perf_counter() - t < 30  # an hour of arrivals, replayed without waiting for them
    assert res.duration_s == pytest.approx(600.0 * (len(far.requests) - 1))
    assert all(r.ttft_ms == 0.0 and r.first_token_s == r.arrival_s for r in res.requests)
    assert res.meta["priced"] is False and res.telemetry == []


def test_stub_refuses_what_it_cannot_replay(model_dir, workload):
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match="ignore_eos"):
        make_backend(model_dir, _config({"ignore_eos": False}), kind="stub")
    with pytest.raises(ConfigError, match="top_k_override=6"):
        make_backend(model_dir, _config({"top_k_override": 6}), kind="stub")
    with pytest.raises(ConfigError, match="compute_dtype='auto'"):
        make_backend(model_dir, EngineConfig(), kind="stub")
    with pytest.raises(ConfigError, match="no router trace"):
        run_workload(make_backend(model_dir, _config({}), kind="stub"), _workload(), mode="offline")
    with pytest.raises(ConfigError, match="needs calibrated costs"):
        run_workload(make_backend(model_dir, _config(CASES["static-auto"]), kind="stub"), workload, mode="offline")
    short = Workload("short", [Request("r0", 0.0, workload.requests[0].prompt_len, 50)], {})
    with pytest.raises(ConfigError, match="the run needs at least"):
        run_workload(make_backend(model_dir, _config({}), kind="stub", trace=workload.router_trace), short,
                     mode="offline")


STUB_WITHOUT_TORCH = """
import json, sys
sys.modules["torch"] = None  # any import of torch now fails
from engine.backend import make_backend
from engine.backend_stub import StubBackend
from engine.config import EngineConfig
from engine.model.arch import read_config
from engine.runner import run_workload
from workloads.schema import load_workload
from pathlib import Path

model, wl_path, knobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
wl = load_workload(wl_path)
_, spec = read_config(Path(model))
cfg = EngineConfig().replace(**knobs)
stub = StubBackend(spec, cfg, identity=wl.router_trace.model_identity, weight_precision="fp32")
res = run_workload(stub, wl, mode="offline", decisions=True)
print(json.dumps(res.decisions))
"""


def test_stub_runs_without_torch(model_dir, workload, tmp_path):
    from workloads.schema import save_workload

    path = save_workload(workload, tmp_path / "wl")
    knobs = {**CASES["cache-lru-prefetch"], "compute_dtype": "float32", "max_batch_seqs": 3,
             "max_batch_tokens": 24, "prefill_chunk_tokens": 5}
    proc = subprocess.run([sys.executable, "-c", STUB_WITHOUT_TORCH, model_dir, str(path), json.dumps(knobs)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    stub = make_backend(model_dir, EngineConfig().replace(**knobs), kind="stub")
    assert got == run_workload(stub, workload, mode="offline", decisions=True).decisions
