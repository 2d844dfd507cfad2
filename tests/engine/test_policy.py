"""The placement policies of engine/moe/policy: budgets, plans, dynamic residency, caches, replicas,
host-vs-fetch decisions, batching and route pruning. Pure numpy; no model, no device."""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.moe.policy import (
    CostModel,
    DynamicResidency,
    ExpertCache,
    ResidencyPlan,
    TransitionTable,
    crossover_tokens,
    decide,
    fit_compute_cost,
    layer_budgets,
    micro_batches,
    plan_layer,
    plan_replicas,
    plan_static,
    prune_routes,
    split_slices,
    split_tokens,
    step_slices,
)

POLICY_DIR = Path(__file__).resolve().parents[2] / "engine" / "moe" / "policy"


def test_policies_import_no_torch() -> None:
    """Policies must run in a simulator without a device: numpy and the standard library only."""
    for path in sorted(POLICY_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                root = name.split(".")[0]
                assert root in {"numpy", "engine", "__future__", "collections", "dataclasses", "typing",
                                "math", "itertools"}, f"{path.name} imports {name}"
                if root == "engine":
                    assert name.startswith("engine.moe.policy"), f"{path.name} imports {name}"


# ----------------------------------------------------------------------------------------- budgets

@pytest.mark.parametrize("total", [0, 1, 7, 1000, 10**11 + 3])
def test_layer_budgets_sum_exactly(total: int) -> None:
    load = np.array([5.0, 1.0, 0.0, 2.0])
    for split, kw in (("uniform", {}), ("proportional", {"load": load}), ("vector", {"vector": [0.1, 0.2, 0.3, 0.4]})):
        b = layer_budgets(total, split, 4, **kw)
        assert b.dtype == np.int64 and b.shape == (4,) and b.min() >= 0
        assert int(b.sum()) == total, (split, b)


def test_layer_budgets_shares() -> None:
    assert layer_budgets(100, "uniform", 4).tolist() == [25, 25, 25, 25]
    assert layer_budgets(10, "uniform", 4).tolist() == [3, 3, 2, 2]
    assert layer_budgets(800, "proportional", 4, load=[4, 2, 1, 1]).tolist() == [400, 200, 100, 100]
    # vector fractions are normalised
    assert layer_budgets(900, "vector", 3, vector=[2, 1, 0]).tolist() == [600, 300, 0]
    # no load anywhere: uniform
    assert layer_budgets(90, "proportional", 3, load=[0, 0, 0]).tolist() == [30, 30, 30]
    with pytest.raises(ValueError, match="load"):
        layer_budgets(10, "proportional", 3)
    with pytest.raises(ValueError, match="vector"):
        layer_budgets(10, "vector", 3, vector=[1, 2])
    with pytest.raises(ValueError, match="split"):
        layer_budgets(10, "equal", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        layer_budgets(10, "vector", 2, vector=[1, -1])


# ----------------------------------------------------------------------------------------- static plans

def _hotness(rng: np.random.Generator, n_layers: int, n_experts: int) -> np.ndarray:
    raw = rng.gamma(0.5, size=(n_layers, n_experts))
    return raw / raw.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("split", ["uniform", "proportional", "vector"])
@pytest.mark.parametrize("objective", ["precision", "coverage"])
def test_plan_static_respects_budgets(split: str, objective: str) -> None:
    rng = np.random.default_rng(1)
    for trial in range(25):
        n_layers, n_experts = int(rng.integers(1, 6)), int(rng.integers(1, 20))
        b_hi = int(rng.integers(100, 1000))
        b_lo = [None, b_hi // 2, b_hi // 4 + 1][trial % 3]
        total = int(rng.integers(0, n_layers * n_experts * b_hi * 1.2 + 1))
        kw = {"load": rng.random(n_layers)} if split == "proportional" else \
            {"vector": rng.random(n_layers) + 0.01} if split == "vector" else {}
        budgets = layer_budgets(total, split, n_layers, **kw)  # type: ignore[arg-type]
        plan = plan_static(_hotness(rng, n_layers, n_experts), budgets, b_hi, b_lo, objective=objective)  # type: ignore[arg-type]
        used = plan.bytes_used()
        assert np.all(used <= budgets), (used, budgets)
        assert int(used.sum()) <= total
        for layer in range(n_layers):
            hi, lo = set(plan.hi[layer]), set(plan.lo[layer])
            assert not hi & lo
            # nothing more fits: not even one more lo (or hi when there is no lo) copy
            cheapest = b_lo or b_hi
            if len(hi) + len(lo) < n_experts:
                assert budgets[layer] - used[layer] < cheapest


def test_plan_static_picks_hottest_and_fills_lo() -> None:
    hot = np.array([[0.05, 0.40, 0.10, 0.30, 0.15, 0.0],
                    [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]])
    plan = plan_static(hot, [300, 300], bytes_hi=100)
    assert plan.hi == ((1, 3, 4), (0, 1, 2))  # ties go to the lower id
    assert plan.lo == ((), ())
    # 350 bytes: 3 hi (300) + 2 lo of 25 bytes in the 50 left, the next-hottest
    plan = plan_static(hot, [350, 350], bytes_hi=100, bytes_lo=25)
    assert plan.hi[0] == (1, 3, 4) and plan.lo[0] == (0, 2)
    assert plan.hi[1] == (0, 1, 2) and plan.lo[1] == (3, 4)
    assert plan.bytes_used().tolist() == [350, 350]
    assert [plan.tier(0, e) for e in range(6)] == ["lo", "hi", "lo", "hi", "hi", "host"]
    assert plan.resident(0) == frozenset({0, 1, 2, 3, 4})
    # coverage: all 6 in lo (150 bytes), then upgrade the hottest while the 200 left allow (75 each)
    cov = plan_static(hot, [350, 350], bytes_hi=100, bytes_lo=25, objective="coverage")
    assert cov.hi[0] == (1, 3) and cov.lo[0] == (0, 2, 4, 5)
    assert np.all(cov.bytes_used() <= 350)
    with pytest.raises(ValueError, match="smaller"):
        plan_static(hot, [350, 350], bytes_hi=100, bytes_lo=100)


def test_plan_round_trip_and_diff() -> None:
    hot = np.array([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]])
    a = plan_static(hot, [250, 250], 100, 50)
    b = plan_static(hot[::-1], [250, 250], 100, 50)
    back = ResidencyPlan.from_dict(json.loads(json.dumps(a.to_dict())))
    assert back == a and back.hi == a.hi and back.lo == a.lo
    assert np.array_equal(back.tier_codes(), a.tier_codes())
    promotions, demotions = a.diff(b)
    # layer 0: a = hi {0,1} lo {2}; b = hi {2,3} lo {1}
    assert [(m.expert, m.src, m.dst) for m in promotions[0]] == [(2, "lo", "hi"), (3, "host", "hi")]
    assert [(m.expert, m.src, m.dst) for m in demotions[0]] == [(0, "hi", "host"), (1, "hi", "lo")]
    assert a.diff(a) == ([[], []], [[], []])
    bad = a.to_dict()
    bad["hi"][0] = [0, 1, 3]  # 300 + 50 > 250
    with pytest.raises(ValueError, match="over its budget"):
        ResidencyPlan.from_dict(bad)
    bad = a.to_dict()
    bad["lo"][0] = [0]
    with pytest.raises(ValueError, match="both hi and lo"):
        ResidencyPlan.from_dict(bad)
    with pytest.raises(ValueError, match="budgets_bytes"):
        ResidencyPlan.from_dict({k: v for k, v in a.to_dict().items() if k != "budgets_bytes"})


# ----------------------------------------------------------------------------------------- dynamic

def _stream_counts(rng: np.random.Generator, probs: np.ndarray, tokens: int, top_k: int) -> np.ndarray:
    """Routed-token counts [L, E] of `tokens` tokens, each routed to top_k distinct experts drawn from probs."""
    out = np.zeros_like(probs)
    for layer in range(probs.shape[0]):
        for _ in range(tokens):
            out[layer, rng.choice(probs.shape[1], size=top_k, replace=False, p=probs[layer])] += 1
    return out


def _skewed(n_experts: int, hot: list[int], hot_mass: float = 0.8) -> np.ndarray:
    p = np.full(n_experts, (1 - hot_mass) / (n_experts - len(hot)))
    p[hot] = hot_mass / len(hot)
    return p


def test_dynamic_promotes_new_hot_experts_after_a_shift() -> None:
    rng = np.random.default_rng(0)
    n_experts, b_hi, b_lo = 12, 100, 25
    before = _skewed(n_experts, [0, 1, 2, 3])[None]
    after = _skewed(n_experts, [8, 9, 10, 11])[None]
    dyn = DynamicResidency.from_hotness(before, [4 * 100 + 3 * 25], b_hi, b_lo, half_life_tokens=256,
                                        replan_interval_tokens=128, hysteresis=0.2, max_swaps_per_replan=2)
    assert dyn.plan.hi[0] == (0, 1, 2, 3) and dyn.plan.lo[0] == (4, 5, 6)
    results = []
    for _ in range(40):  # 40 x 64 = 2560 tokens, 10 half-lives
        r = dyn.update(_stream_counts(rng, after, 64, 2), 64)
        if r is not None:
            results.append(r)
    assert len(results) == 20
    assert dyn.plan.hi[0] == (8, 9, 10, 11)
    assert np.all(dyn.plan.bytes_used() <= dyn.plan.budgets_bytes)
    assert len(dyn.plan.lo[0]) == 3  # tier sizes are kept
    # the swap cap: at most 2 exchanges and 2 promotions per layer per re-plan
    assert all(r.exchanges[0] <= 2 and len(r.promotions[0]) <= 2 for r in results)
    assert any(r.exchanges[0] == 2 for r in results)
    # new hot experts first displace the cold lo copies (already hotter than them after half a
    # half-life), then take the hi slots once they beat the old hot ones by the margin
    assert {m.expert for m in results[0].promotions[0]} <= {8, 9, 10, 11}
    assert all(m.dst == "lo" for m in results[0].promotions[0]) and results[0].promotions[0]
    first_done = next(i for i, r in enumerate(results) if r.plan.hi[0] == (8, 9, 10, 11))
    assert 2 <= first_done <= 6
    assert all(r.plan.hi[0] == (8, 9, 10, 11) for r in results[first_done:])  # then hi stays put


def test_dynamic_not_before_enough_tokens() -> None:
    rng = np.random.default_rng(3)
    before = _skewed(8, [0, 1])[None]
    after = _skewed(8, [6, 7])[None]
    dyn = DynamicResidency.from_hotness(before, [200], 100, half_life_tokens=10_000,
                                        replan_interval_tokens=64, hysteresis=0.1, max_swaps_per_replan=4)
    for _ in range(4):
        dyn.update(_stream_counts(rng, after, 64, 2), 64)
    assert dyn.plan.hi[0] == (0, 1)  # 256 tokens are a fraction of a 10k-token half-life


def test_hysteresis_prevents_thrash_on_noise() -> None:
    """Stationary stream where the experts at the boundary are equally hot: noise alone makes a
    margin-less policy swap again and again; with a margin it settles."""
    probs = np.array([[0.2, 0.2, 0.15, 0.15, 0.15, 0.15]])  # 2 resident; experts 2..5 equal

    def swaps(hysteresis: float) -> int:
        rng = np.random.default_rng(7)
        dyn = DynamicResidency.from_hotness(probs, [300], 100, half_life_tokens=128,
                                            replan_interval_tokens=32, hysteresis=hysteresis,
                                            max_swaps_per_replan=3)
        total = 0
        for _ in range(100):
            r = dyn.update(_stream_counts(rng, probs, 32, 2), 32)
            assert r is not None
            total += len(r.promotions[0])
        return total

    noisy, damped = swaps(0.0), swaps(0.5)
    assert noisy >= 10, noisy
    assert damped <= 2, damped


def test_dynamic_swap_cap_zero_freezes_plan() -> None:
    rng = np.random.default_rng(5)
    dyn = DynamicResidency.from_hotness(_skewed(8, [0, 1])[None], [200], 100, half_life_tokens=16,
                                        replan_interval_tokens=16, hysteresis=0.0, max_swaps_per_replan=0)
    for _ in range(10):
        r = dyn.update(_stream_counts(rng, _skewed(8, [5, 6])[None], 16, 2), 16)
        assert r is not None and r.promotions == [[]] and r.demotions == [[]]
    assert dyn.plan.hi[0] == (0, 1)


def test_dynamic_cascade_keeps_budget_and_hot_lo() -> None:
    # hi {0}, lo {1, 2}; expert 5 becomes the hottest: 5 -> hi, 0 -> lo, coldest lo -> host
    plan = ResidencyPlan(n_experts=6, bytes_hi=100, bytes_lo=40, budgets_bytes=(180,), hi=((0,),), lo=((1, 2),))
    dyn = DynamicResidency(plan, half_life_tokens=1, replan_interval_tokens=1, hysteresis=0.1,
                           max_swaps_per_replan=1,
                           initial_hotness=np.array([[0.3, 0.2, 0.1, 0.0, 0.0, 0.4]]))
    r = dyn.replan()
    assert r.plan.hi == ((5,),) and r.plan.lo == ((0, 1),)
    assert [(m.expert, m.src, m.dst) for m in r.promotions[0]] == [(5, "host", "hi")]
    assert [(m.expert, m.src, m.dst) for m in r.demotions[0]] == [(0, "hi", "lo"), (2, "lo", "host")]


# ----------------------------------------------------------------------------------------- cache

SEQUENCE = [[1], [2], [1], [3], [2], [1]]


def test_cache_lru_hand_sequence() -> None:
    cache = ExpertCache(1, 4, 2, policy="lru")
    got = [cache.access(0, ids) for ids in SEQUENCE]
    assert [len(a.hits) for a in got] == [0, 0, 1, 0, 0, 0]
    assert [a.evictions for a in got] == [[], [], [], [2], [1], [3]]
    assert (cache.hits, cache.misses, cache.evictions) == (1, 5, 3)
    assert cache.cached(0) == [1, 2]


def test_cache_lfu_hand_sequence() -> None:
    cache = ExpertCache(1, 4, 2, policy="lfu")
    got = [cache.access(0, ids) for ids in SEQUENCE]
    assert [a.hits for a in got] == [[], [], [1], [], [], [1]]
    assert [a.evictions for a in got] == [[], [], [], [2], [3], []]
    assert (cache.hits, cache.misses) == (2, 4)


def test_cache_pins_the_current_access_and_bytes_capacity() -> None:
    cache = ExpertCache.from_budgets(5, [250, 0], bytes_per_expert=100)
    assert cache.capacity_experts == [2, 0]
    a = cache.access(0, [0, 1, 2, 2, -1])
    assert a.misses == [0, 1, 2] and a.evictions == []  # 2 finds no room: 0 and 1 are in use
    assert cache.cached(0) == [0, 1]
    assert cache.access(1, [3]) == ([], [3], [])
    assert cache.cached(1) == []
    assert cache.prefetch(0, [4]) == [0]
    assert cache.access(0, [4]).hits == [4]


def test_prefetch_learns_co_occurrence() -> None:
    # deterministic routes: layer-0 expert e always goes to layer-1 expert (e + 3) % 8, then (e + 5) % 8
    n_experts = 8
    rng = np.random.default_rng(11)
    first = np.stack([rng.choice(n_experts, 2, replace=False) for _ in range(400)])
    ids = np.stack([first, (first + 3) % n_experts, (first + 5) % n_experts], axis=1)  # [T, 3, 2]
    cache = ExpertCache(3, n_experts, 2, policy="lru")
    assert cache.prefetch_candidates(1, [0], 2) == [0, 1]  # nothing learned yet: lowest ids
    for chunk in np.array_split(ids, 10):
        cache.observe(chunk)
    for e in range(n_experts):
        assert cache.prefetch_candidates(1, [e], 1) == [(e + 3) % n_experts]
        assert cache.prefetch_candidates(2, [(e + 3) % n_experts], 1) == [(e + 5) % n_experts]
    assert sorted(cache.prefetch_candidates(1, [2, 6], 2)) == [1, 5]
    cache.access(1, [5])
    assert cache.prefetch_candidates(1, [2, 6], 2)[0] == 1  # 5 is cached already
    table = TransitionTable.from_expert_ids(ids, n_experts)
    assert np.array_equal(table.counts, cache.transitions.counts)
    with pytest.raises(ValueError, match="next_layer"):
        table.predict(3, [0], 1)


# ----------------------------------------------------------------------------------------- replicas

def test_replicas_only_for_overloaded_capped_and_in_budget() -> None:
    counts = np.array([[100, 10, 10, 10, 10, 10, 10, 10],   # mean 21.25; 100 > 2x mean
                       [20, 20, 20, 20, 20, 20, 20, 20],      # balanced: none
                       [300, 200, 10, 10, 10, 10, 10, 10]])   # two overloaded; 300 is worse
    plan = plan_replicas(counts, threshold=2.0, max_replicas=3, spare_bytes_per_layer=[1000, 1000, 250],
                         bytes_per_replica=100)
    assert plan[0] == {0: 2}  # ceil(100 / 42.5) - 1 = 2 replicas bring it under 2x the mean
    assert plan[1] == {}
    # layer 2: limit 2 x 70 = 140 tokens per copy; 300 wants 2, 200 wants 1; 2 slots (250 // 100),
    # handed to the highest tokens-per-copy first: 300 (300/1) then 200 (200/1 > 300/2)
    assert plan[2] == {0: 1, 1: 1}
    capped = plan_replicas(counts, 2.0, 1, [10**6] * 3, 100)
    assert capped[0] == {0: 1} and capped[2] == {0: 1, 1: 1}
    assert plan_replicas(counts, 2.0, 3, [99, 99, 99], 100) == {0: {}, 1: {}, 2: {}}
    only = plan_replicas(counts, 2.0, 3, [1000] * 3, 100, eligible=[set(), set(), {1}])
    assert only == {0: {}, 1: {}, 2: {1: 1}}
    for layer, reps in plan.items():
        assert sum(reps.values()) * 100 <= [1000, 1000, 250][layer]
        for expert in reps:
            assert counts[layer, expert] > 2.0 * counts[layer].mean()


def test_split_tokens() -> None:
    assert split_tokens(10, 3) == [4, 3, 3]
    assert split_tokens(2, 4) == [1, 1, 0, 0]
    assert split_tokens(0, 2) == [0, 0]
    assert split_tokens(10, 2, weights=[3, 1]) == [8, 2]  # 7.5 / 2.5: tie goes to the first
    assert split_slices(10, 3) == [slice(0, 4), slice(4, 7), slice(7, 10)]
    for n in range(30):
        for c in range(1, 6):
            parts = split_tokens(n, c)
            assert sum(parts) == n and max(parts) - min(parts) <= 1
    with pytest.raises(ValueError, match="n_copies"):
        split_tokens(3, 0)


# ----------------------------------------------------------------------------------------- execution

def _cost() -> CostModel:
    """Test-only costs: a host 100x slower per token than the device, a 10 GB/s link."""
    return CostModel.from_measurements({
        "default_precision": "bf16",
        "link": {"bandwidth_bytes_per_s": 1e10, "latency_s": 1e-5},
        "host": {"bf16": {"overhead_s": 2e-5, "weight_s_per_byte": 1e-11, "token_s_per_byte": 1e-12},
                 "int4": {"overhead_s": 2e-5, "weight_s_per_byte": 1e-11, "token_s_per_byte": 4e-12}},
        "device": {"bf16": {"overhead_s": 1e-5, "weight_s_per_byte": 1e-13, "token_s_per_byte": 1e-14},
                   "int4": {"overhead_s": 1e-5, "weight_s_per_byte": 1e-13, "token_s_per_byte": 4e-14}},
    })


def test_decide_host_for_few_tokens_fetch_for_many_at_the_crossover() -> None:
    cost = _cost()
    nbytes = 10_000_000
    # by hand: fetch fixed = 1e-5 + 1e-3 + 1e-5 + 1e-6 ; host fixed = 2e-5 + 1e-4
    # per token: host 1e-5, device 1e-7  ->  t* = (1.021e-3 - 1.2e-4) / (9.9e-6)
    expected = (1e-5 + nbytes / 1e10 + 1e-5 + 1e-13 * nbytes - 2e-5 - 1e-11 * nbytes) / ((1e-12 - 1e-14) * nbytes)
    t_star = crossover_tokens(nbytes, cost)
    assert t_star == pytest.approx(expected, rel=1e-12)
    assert 90 < t_star < 92
    assert decide(1, nbytes, "auto", cost) == "host"
    assert decide(math.floor(t_star), nbytes, "auto", cost) == "host"
    assert decide(math.ceil(t_star), nbytes, "auto", cost) == "fetch"
    assert decide(10_000, nbytes, "auto", cost) == "fetch"
    assert decide(0, nbytes, "auto", cost) == "host"
    assert decide(10_000, nbytes, "host", None) == "host"
    assert decide(1, nbytes, "fetch", None) == "fetch"
    # int4 weights: a quarter of the bytes to move, same per-byte work ratio -> an earlier crossover
    assert crossover_tokens(nbytes // 4, cost, "int4") < t_star
    with pytest.raises(ValueError, match="cost model"):
        decide(5, nbytes, "auto", None)
    with pytest.raises(ValueError, match="precision 'fp8'"):
        decide(5, nbytes, "auto", cost, "fp8")


def test_cost_model_round_trip_and_validation() -> None:
    cost = _cost()
    assert CostModel.from_measurements(json.loads(json.dumps(cost.to_dict()))) == cost
    bad = cost.to_dict()
    del bad["link"]["latency_s"]
    with pytest.raises(ValueError, match=r"link\.latency_s"):
        CostModel.from_measurements(bad)
    bad = cost.to_dict()
    bad["host"]["bf16"]["overhead_s"] = -1
    with pytest.raises(ValueError, match=r"host\.bf16\.overhead_s"):
        CostModel.from_measurements(bad)
    bad = cost.to_dict()
    bad["default_precision"] = "fp8"
    with pytest.raises(ValueError, match="default_precision"):
        CostModel.from_measurements(bad)


def test_fit_compute_cost_recovers_coefficients() -> None:
    truth = (3e-5, 2e-11, 5e-13)
    samples = [(t, b, truth[0] + b * (truth[1] + t * truth[2])) for t in (1, 4, 16, 64) for b in (10**6, 4 * 10**6)]
    fit = fit_compute_cost(samples)
    assert (fit.overhead_s, fit.weight_s_per_byte, fit.token_s_per_byte) == pytest.approx(truth, rel=1e-6)
    flat = fit_compute_cost([(1, 10**6, 1e-3), (8, 10**6, 1e-3)])  # no token dependence
    assert flat.token_s_per_byte == 0 and flat.overhead_s + flat.weight_s_per_byte * 10**6 == pytest.approx(1e-3)


def test_plan_layer() -> None:
    cost = _cost()
    nbytes = 10_000_000
    counts = {7: 500, 3: 2, 5: 300, 1: 0, 2: 1000}
    placed = plan_layer(counts, resident={2, 9}, mode="auto", cost=cost, expert_bytes=nbytes)
    assert placed == {2: "resident", 3: "host", 5: "fetch", 7: "fetch"}
    assert list(placed) == [2, 3, 5, 7]
    # room to fetch one: the one fetching saves most (more tokens) is fetched
    placed = plan_layer(counts, {2}, "auto", cost, nbytes, fetch_budget_bytes=nbytes)
    assert placed == {2: "resident", 3: "host", 5: "host", 7: "fetch"}
    assert plan_layer(counts, set(), "host", None, nbytes) == {2: "host", 3: "host", 5: "host", 7: "host"}
    assert plan_layer(counts, set(), "fetch", None, nbytes, fetch_budget_bytes=2 * nbytes) == \
        {2: "fetch", 3: "host", 5: "host", 7: "fetch"}


# ----------------------------------------------------------------------------------------- batching, routing

def test_micro_batches() -> None:
    assert micro_batches(10, 4) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert micro_batches(10, None) == [slice(0, 10)]
    assert micro_batches(10, 64) == [slice(0, 10)]
    assert micro_batches(0, 4) == []
    assert step_slices(7, "coalesced") == [slice(0, 7)]
    assert step_slices(7, "micro", 3) == [slice(0, 3), slice(3, 6), slice(6, 7)]
    for n in range(20):
        for m in range(1, 8):
            covered = [i for s in micro_batches(n, m) for i in range(n)[s]]
            assert covered == list(range(n))
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        micro_batches(10, 0)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        step_slices(10, "micro")


def test_prune_routes_threshold_renormalise_top1() -> None:
    w = np.array([[0.6, 0.3, 0.1], [0.34, 0.33, 0.33], [0.1, 0.5, 0.4]], np.float32)
    ids = np.array([[4, 1, 7], [0, 2, 3], [5, 6, 7]], np.int64)
    out_w, out_ids, mask = prune_routes(w, ids, None, 0.2)
    assert mask.tolist() == [[True, True, False], [True, True, True], [False, True, True]]
    assert out_ids.tolist() == [[4, 1, -1], [0, 2, 3], [-1, 6, 7]]
    np.testing.assert_allclose(out_w, [[2 / 3, 1 / 3, 0], [0.34, 0.33, 0.33], [0, 5 / 9, 4 / 9]], rtol=1e-6)
    assert out_w.dtype == np.float32 and out_ids.dtype == np.int64
    # a threshold above every weight keeps only the top-1, with the whole weight
    out_w, out_ids, mask = prune_routes(w, ids, None, 0.9)
    assert mask.sum(axis=1).tolist() == [1, 1, 1]
    assert out_ids.tolist() == [[4, -1, -1], [0, -1, -1], [-1, 6, -1]]
    np.testing.assert_allclose(out_w.sum(axis=1), 1.0, rtol=1e-6)
    # threshold 0: unchanged
    out_w, out_ids, mask = prune_routes(w, ids, None, 0.0)
    assert mask.all() and np.array_equal(out_w, w) and np.array_equal(out_ids, ids)
    # top-k override: the k largest, renormalised to the row's sum; then the threshold on top of it
    out_w, out_ids, mask = prune_routes(w, ids, 2, 0.0)
    assert mask.tolist() == [[True, True, False], [True, True, False], [False, True, True]]
    np.testing.assert_allclose(out_w[0], [2 / 3, 1 / 3, 0], rtol=1e-6)
    out_w, _, mask = prune_routes(w, ids, 2, 0.45)  # normalised among the top-2: 0.3/0.9, 0.4/0.9 < 0.45
    assert mask.tolist() == [[True, False, False], [True, True, False], [False, True, False]]
    np.testing.assert_allclose(out_w[1], [0.34 / 0.67, 0.33 / 0.67, 0], rtol=1e-6)
    # weights that do not sum to 1 (no top-k renormalisation in the model) keep their total
    raw = w * 0.5
    out_w, _, _ = prune_routes(raw, ids, None, 0.2)
    np.testing.assert_allclose(out_w.sum(axis=1), raw.sum(axis=1), rtol=1e-6)
    with pytest.raises(ValueError, match="top_k_override"):
        prune_routes(w, ids, 4, 0.0)
    with pytest.raises(ValueError, match="min_gate_weight"):
        prune_routes(w, ids, None, 1.5)


def test_prune_routes_random_invariants() -> None:
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(200, 6))
    w = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    ids = np.argsort(-rng.random((200, 6)), axis=1)
    for k in (None, 1, 3):
        for thr in (0.0, 0.1, 0.3, 1.0):
            out_w, out_ids, mask = prune_routes(w, ids, k, thr)
            assert mask[np.arange(200), w.argmax(axis=1)].all()  # top-1 always kept
            np.testing.assert_allclose(out_w.sum(axis=1), 1.0, rtol=1e-9)
            assert np.all((out_ids == -1) == ~mask) and np.all(out_w[~mask] == 0)
            if k is not None:
                assert mask.sum(axis=1).max() <= k


# ----------------------------------------------------------------------------------------- determinism

def _run_policies() -> tuple:
    """Every policy's decisions on one fixed input, as comparable text."""
    rng = np.random.default_rng(42)
    hot = _hotness(rng, 3, 10)
    budgets = layer_budgets(2000, "proportional", 3, load=hot.max(axis=1))
    plan = plan_static(hot, budgets, 200, 50)
    dyn = DynamicResidency(plan, half_life_tokens=64, replan_interval_tokens=32, hysteresis=0.1,
                           max_swaps_per_replan=2, initial_hotness=hot)
    moves = []
    for _ in range(8):
        r = dyn.update(rng.integers(0, 20, size=(3, 10)).astype(float), 32)
        moves.append((r.promotions, r.demotions) if r else None)
    cache = ExpertCache(3, 10, 3, policy="lfu")
    hits = [cache.access(i % 3, rng.integers(0, 10, 4).tolist()) for i in range(30)]
    reps = plan_replicas(rng.integers(0, 100, size=(3, 10)), 1.5, 2, [400, 400, 400], 100)
    pruned = prune_routes(rng.random((16, 4)), rng.integers(0, 10, (16, 4)), 3, 0.2)
    return (json.dumps(plan.to_dict()), json.dumps(dyn.plan.to_dict()), repr(moves), repr(hits),
            repr(reps), [a.hex() for a in (x.tobytes() for x in pruned)])


def _decisions() -> str:
    return hashlib.sha256(repr(_run_policies()).encode()).hexdigest()


def test_same_inputs_same_decisions_in_other_processes() -> None:
    """Policies are pure: fresh processes with other hash seeds (which reorder sets and dicts of strings)
    decide exactly as this one does. Decisions that leaked the time, a global RNG or iteration order of a
    hashed container would differ between them."""
    here_dir = str(Path(__file__).parent)
    code = f"import sys; sys.path.insert(0, {here_dir!r}); import test_policy as t; print(t._decisions())"
    here = _decisions()
    for seed in ("1", "987654"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert other.returncode == 0, other.stderr[-2000:]
        assert other.stdout.strip().splitlines()[-1] == here, f"PYTHONHASHSEED={seed}"


class _ReferenceCache:
    """The cache's rules handled one expert at a time (each miss picks its victim by a full scan): the
    oracle for :class:`ExpertCache`, which hands out an access's slots at once."""

    def __init__(self, n_layers, capacity, policy):
        self.cap, self.policy = capacity, policy
        self.last = [{} for _ in range(n_layers)]
        self.freq = [[0] * 64 for _ in range(n_layers)]
        self.clock = 0

    def _admit(self, layer, e, pinned, evicted):
        cache = self.last[layer]
        if len(cache) >= self.cap:
            entries = [x for x in cache if x not in pinned]
            if not entries:
                return
            key = (lambda x: (cache[x], -x)) if self.policy == "lru" else \
                (lambda x: (self.freq[layer][x], cache[x], -x))
            victim = min(entries, key=key)
            del cache[victim]
            evicted.append(victim)
        cache[e] = self.clock

    def access(self, layer, ids):
        ids = list(dict.fromkeys(int(e) for e in ids if e != -1))
        cache, hits, misses, evicted = self.last[layer], [], [], []
        for e in ids:
            self.clock += 1
            self.freq[layer][e] += 1
            if e in cache:
                cache[e] = self.clock
                hits.append(e)
            else:
                misses.append(e)
                self._admit(layer, e, set(ids), evicted)
        return hits, misses, evicted

    def prefetch(self, layer, ids):
        ids = list(dict.fromkeys(int(e) for e in ids if e != -1))
        evicted = []
        for e in ids:
            self.clock += 1
            if e in self.last[layer]:
                self.last[layer][e] = self.clock
            else:
                self._admit(layer, e, set(ids), evicted)
        return evicted


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("capacity", [0, 1, 5, 17, 64])
def test_cache_matches_one_expert_at_a_time_reference(policy, capacity):
    rng = np.random.default_rng(capacity + (policy == "lfu"))
    fast, ref = ExpertCache(2, 64, capacity, policy=policy), _ReferenceCache(2, capacity, policy)
    for step in range(300):
        layer = int(rng.integers(2))
        n = int(rng.integers(0, 40))
        ids = (rng.zipf(1.3, n) % 64 if step % 3 else rng.integers(-1, 64, n)).tolist()
        if step % 7 == 0:
            assert fast.prefetch(layer, ids) == ref.prefetch(layer, ids)
        else:
            got = fast.access(layer, ids)
            assert (got.hits, got.misses, got.evictions) == ref.access(layer, ids), step
        assert fast.cached(layer) == sorted(ref.last[layer])


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_cache_step_access_matches_layer_after_layer(policy):
    """access_step (every layer at once, as arrays) against access of one layer after another: the same
    hits, misses, victims in eviction order, admissions and cached sets, step after step; layers of
    capacities 0 (nothing admitted), few (victims run out when a step routes more than that) and all."""
    rng = np.random.default_rng(11 + (policy == "lfu"))
    caps = [0, 1, 3, 8, 17, 40]
    step_wise, layer_wise = ExpertCache(6, 40, caps, policy=policy), ExpertCache(6, 40, caps, policy=policy)
    for step in range(200):
        n = int(rng.integers(1, 30)) if step % 5 else 40
        routed = np.zeros((6, 40), bool)
        for layer in range(6):
            routed[layer, rng.zipf(1.4, n) % 40] = True
        got = step_wise.access_step(routed)
        for layer in range(6):
            want = layer_wise.access(layer, np.flatnonzero(routed[layer]).tolist())
            access, admitted = got.layer(layer)
            assert (access.hits, access.misses, access.evictions) == (want.hits, want.misses, want.evictions), step
            assert list(admitted) == [e for e in want.misses if e in set(layer_wise.cached(layer))]
            assert step_wise.cached(layer) == layer_wise.cached(layer)
    assert (step_wise.hits, step_wise.misses, step_wise.evictions) == (layer_wise.hits, layer_wise.misses,
                                                                       layer_wise.evictions)


@pytest.mark.parametrize("mode", ["host", "fetch", "auto"])
@pytest.mark.parametrize("tier_dtype", [np.int8, np.int64])
def test_plan_where_places_every_layer_as_plan_run_arrays_does(mode, tier_dtype):
    """plan_where (all layers at once; a table lookup for host and fetch) against plan_run_arrays
    layer by layer: unrouted experts -1, every tier, counts on both sides of auto's crossover."""
    from engine.moe.policy.plan import plan_run_arrays, plan_where

    rng = np.random.default_rng(3)
    counts = rng.integers(0, 200, (6, 40)) * (rng.random((6, 40)) < 0.6)
    tiers = rng.integers(0, 3, (6, 40)).astype(tier_dtype)
    cost = _cost() if mode == "auto" else None
    where = plan_where(counts, tiers, mode, cost, 10_000_000)
    assert where.dtype == np.int8 and where.shape == (6, 40)
    for layer in range(6):
        runs = plan_run_arrays(counts[layer], tiers[layer], np.zeros(40, np.int64), mode, cost, 10_000_000)
        want = np.full(40, -1, np.int8)
        want[runs.experts] = runs.where
        np.testing.assert_array_equal(where[layer], want)
    if mode == "auto":
        assert {2, 3} <= set(where[tiers == 0].tolist())  # some missing experts on the host, some fetched


def _replicas_one_at_a_time(counts, threshold, max_replicas, spare, nbytes):
    """plan_replicas' rule handed out literally: one replica at a time to the expert with the most
    tokens per copy (ties: lower id) while it wants more and the layer has room."""
    out = {}
    for layer, row in enumerate(np.asarray(counts, dtype=np.float64)):
        n = len(row)
        limit = threshold * row.sum() / n
        want = [min(math.ceil(c / limit) - 1, max_replicas) if row.sum() > 0 and c > limit else 0 for c in row]
        want = [max(w, 1) if c > limit and row.sum() > 0 else 0 for w, c in zip(want, row, strict=True)]
        given = [0] * n
        for _ in range(min(spare[layer] // nbytes, max_replicas * n) if max_replicas else 0):
            open_ = [e for e in range(n) if given[e] < want[e]]
            if not open_:
                break
            pick = min(open_, key=lambda e: (-(row[e] / (given[e] + 1)), e))
            given[pick] += 1
        out[layer] = {e: g for e, g in enumerate(given) if g}
    return out


@pytest.mark.parametrize("seed", range(6))
def test_replicas_go_to_the_most_tokens_per_copy_as_if_one_at_a_time(seed):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 6, size=(4, 24)) * rng.choice([1, 10, 50], size=(4, 24))  # ties in count / k
    counts[:, :3] *= 20  # a few hot experts
    counts[3] = 0  # a layer without tokens
    spare = [int(rng.integers(0, 3000)) for _ in range(4)]
    for max_replicas in (1, 3, 7):
        want = _replicas_one_at_a_time(counts, 1.5, max_replicas, spare, 100)
        assert plan_replicas(counts, 1.5, max_replicas, spare, 100) == want
    assert any(want.values())


def test_moe_stats_per_step_and_per_layer_records_agree():
    """add_step (the fused step's whole-step record, its last counts split by layer only when read) keeps
    what add (layer by layer) keeps: accumulated counts, the last step's counts, distinct experts, calls."""
    from engine.moe.policy.plan import MoEStats

    rng = np.random.default_rng(3)
    steps = [rng.integers(0, 3, (3, 5)) for _ in range(4)]
    whole, by_layer, layers = MoEStats(), MoEStats(), (1, 2, 4)
    for i, c in enumerate(steps):
        whole.add_step(layers, c)
        for li, layer in enumerate(layers):
            by_layer.add(layer, c[li])
        if i == 1:  # a layer recorded on its own between whole steps
            whole.add(4, np.array([1, 0, 0, 0, 2]))
            by_layer.add(4, np.array([1, 0, 0, 0, 2]))
        assert {k: v.tolist() for k, v in whole.last.items()} == {k: v.tolist() for k, v in by_layer.last.items()}
        assert {k: v.tolist() for k, v in whole.counts.items()} == {k: v.tolist() for k, v in by_layer.counts.items()}
    assert (whole.distinct_experts, whole.layer_calls) == (by_layer.distinct_experts, by_layer.layer_calls)
    whole.add_step((1, 2, 4), steps[0])  # not read before the next step's other layers, nor step_counts
    whole.add_step((5, 6), steps[1][:2])
    assert whole.step_counts((4, 1, 6)).tolist() == [steps[0][2].tolist(), steps[0][0].tolist(), steps[1][1].tolist()]
    whole.reset()
    assert whole.last == {} and whole.counts == {} and whole.layer_calls == 0
