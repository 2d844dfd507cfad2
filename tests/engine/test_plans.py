"""Per-step expert plans: the placement function, the residency controller, statistics from plans.
Pure numpy (no model, no device)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from engine.moe.policy import CostModel
from engine.moe.policy.controller import PlanSettings, ResidencyController
from engine.moe.policy.plan import DecisionLog, ExpertRun, plan_runs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", ["engine/backend.py", "engine/backend_stub.py", "engine/sequences.py",
                                  "engine/moe/planning.py", "engine/precision.py", "engine/moe/policy/plan.py",
                                  "engine/moe/policy/controller.py"])
def test_decision_code_imports_no_torch_at_module_level(path):
    tree = ast.parse((ROOT / path).read_text())
    for node in tree.body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        for name in names:
            assert name.split(".")[0] not in {"torch", "safetensors"}, f"{path} imports {name}"
            assert name not in {"engine.runtime", "engine.model.decoder", "engine.moe.experts",
                                "engine.model.checkpoint", "engine.backend_live"}, f"{path} imports {name}"


def test_plan_runs_places_every_routed_expert():
    counts = np.array([0, 5, 1, 3, 0, 2])
    tiers = np.array([2, 2, 1, 0, 0, 0])  # hi, hi, lo, host...
    replicas = np.array([0, 2, 0, 0, 0, 0])
    runs = plan_runs(counts, tiers, replicas, "host", None, 100)
    assert runs == (ExpertRun(1, 5, "hi", (2, 2, 1)), ExpertRun(2, 1, "lo"), ExpertRun(3, 3, "host"),
                    ExpertRun(5, 2, "host"))
    assert [r.where for r in plan_runs(counts, tiers, replicas, "fetch", None, 100)][-2:] == ["fetch", "fetch"]
    # auto: a fetch pays only for busy experts under these costs
    costs = CostModel.from_measurements({
        "default_precision": "fp32", "link": {"bandwidth_bytes_per_s": 400.0, "latency_s": 0.0},
        "host": {"fp32": {"overhead_s": 0.0, "weight_s_per_byte": 0.0, "token_s_per_byte": 1e-3}},
        "device": {"fp32": {"overhead_s": 0.0, "weight_s_per_byte": 0.0, "token_s_per_byte": 0.0}}})
    auto = {r.expert: r.where for r in plan_runs(counts, tiers, replicas, "auto", costs, 100)}
    assert auto[3] == "fetch" and auto[5] == "host"  # host 0.1 s a token; a fetch moves 100 B in 0.25 s
    with pytest.raises(ValueError, match="cost model"):
        plan_runs(counts, tiers, replicas, "auto", None, 100)


def _settings(**kw) -> PlanSettings:
    base = dict(n_layers=2, n_experts=8, bytes_hi=10, bytes_host=10, resident_as_loaded=False)
    return PlanSettings(**{**base, **kw})


def test_trivial_plans_are_built_on_demand_and_counted():
    ctl = ResidencyController(PlanSettings(2, 8))
    ids = np.array([[0, 3], [3, 7], [-1, 0]])
    d = ctl.plan_layer(0, ids)
    assert d._parts is None and d.counts.tolist() == [2, 0, 0, 2, 0, 0, 0, 1]
    assert [(r.expert, r.tokens, r.where) for r in d.parts[0].runs] == [(0, 2, "hi"), (3, 2, "hi"), (7, 1, "hi")]
    assert ctl.stats.expert_calls_fast_hi == 3 and ctl.stats.bytes_to_fast == 0


def test_cache_access_pins_the_micro_batch_together_and_counts():
    ctl = ResidencyController(_settings(residency="cache", budget_bytes=2 * 2 * 10, missing="host"))
    d = ctl.plan_layer(0, np.array([[1, 2], [3, 1]]))  # 3 experts, room for 2
    part = d.parts[0]
    assert part.admitted == (1, 2) and part.cache.evictions == []  # none of an access evicts another
    assert {r.expert: r.where for r in part.runs} == {1: "hi", 2: "hi", 3: "host"}
    d2 = ctl.plan_layer(0, np.array([[3, 4]]))  # both miss: the two cached are evicted, LRU first
    assert d2.parts[0].cache.evictions == [1, 2] and d2.parts[0].admitted == (3, 4)
    st = ctl.stats
    assert (st.cache_hits, st.cache_misses, st.cache_evictions) == (0, 5, 2)
    assert st.bytes_to_fast == 4 * 10 and st.bytes_evicted == 2 * 10 and st.expert_calls_host == 1


def test_swap_limit_is_a_knob_with_a_documented_default():
    hot = np.full((2, 16), 1 / 16)
    assert _settings(n_experts=16).max_swaps_per_replan == 2  # one per 8 experts
    assert _settings(n_experts=4).max_swaps_per_replan == 1
    for limit, want in ((1, 1), (0, 2), (5, 5)):
        ctl = ResidencyController(_settings(n_experts=16, residency="dynamic", budget_bytes=2 * 6 * 10,
                                            dynamic_replan_tokens=4, dynamic_half_life_tokens=1.0,
                                            dynamic_hysteresis=0.0, dynamic_max_swaps=limit), hot)
        counts = np.zeros((2, 16))
        counts[:, 10:] = 50  # six cold experts became the hottest
        moves = ctl.end_step(counts, 100)
        assert moves.replanned and max(sum(1 for m in moves.promotions if m.layer == la) for la in (0, 1)) == want


def test_plans_and_moves_log_as_json_lines():
    log = DecisionLog()
    ctl = ResidencyController(_settings(residency="static", budget_bytes=2 * 3 * 10, missing="fetch"), log=log)
    ctl.plan_layer(0, np.array([[0, 1], [0, 5]]))
    ctl.plan_layer(1, np.array([[2, 3], [4, 3]]))
    ctl.end_step(None, 2)
    lines = [json.loads(json.dumps(e)) for e in log.entries]
    assert lines[0] == {"step": -1, "hi": [[0, 1, 2], [0, 1, 2]], "lo": [[], []]}
    assert lines[1] == {"step": 0, "layer": 0, "parts": [{"rows": [0, 2], "hi": [[0, 2], [1, 1]],
                                                          "fetch": [[5, 1]]}]}
    assert lines[2]["parts"][0]["fetch"] == [[3, 2], [4, 1]] and len(lines) == 3 and log.step == 1
    st = ctl.stats
    assert (st.expert_calls_fast_hi, st.expert_calls_fetched) == (3, 3)
    assert st.bytes_to_fast == 2 * 3 * 10 + 3 * 10  # the initial placement, then three fetches

    log = DecisionLog()
    rep = ResidencyController(_settings(budget_bytes=2 * 10 * 10, max_replicas=2, replica_threshold=1.1,
                                        replica_window_tokens=1), log=log)
    moves = rep.end_step(np.array([[6, 1, 1, 0, 0, 0, 0, 0], [0] * 8]), 4)
    assert moves.replicas and moves.replicas[0] == (0, 0, 2)
    d = rep.plan_layer(0, np.array([[0, 1], [0, 0], [0, 2], [0, 0]]))
    assert d.parts[0].runs[0] == ExpertRun(0, 6, "hi", (2, 2, 2))
    assert log.entries[1]["moves"] == {"replicas": [[0, 0, 2]]}
    assert log.entries[2]["parts"][0]["split"] == [[0, [2, 2, 2]]] and rep.stats.replica_calls == 2
