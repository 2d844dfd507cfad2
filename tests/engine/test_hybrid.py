"""The hybrid MoE layer: knobs that must not change the maths don't; the ones that do are measured."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import ConfigError, EngineConfig, inert_knobs
from engine.model.maker import make_model
from engine.moe.policy import prune_routes
from engine.quality import evaluate
from engine.runner import run_workload
from engine.runtime import Engine
from workloads import Request, Workload

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [100, 200, 300, 4, 5], [7] * 17]
# Same-precision hybrid paths reorder no arithmetic inside an expert; only the final weighted sum
# over experts may be done in another order, so greedy tokens must match exactly and logits to fp32
# rounding.
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid-model")
    make_model(d, "qwen2_moe", "tiny", seed=4, dtype="float32",
               config_overrides=dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32))
    return str(d)


@pytest.fixture(scope="module")
def reference(model_dir):
    eng = Engine(model_dir, EngineConfig().replace(max_batch_seqs=4))
    return eng.generate(PROMPTS, 6), [_logits(eng, p) for p in PROMPTS]


def _logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    from engine.quality import prompt_logits

    return prompt_logits(engine, prompt)


EXPERT_BYTES = 3 * 64 * 32 * 4  # one tiny fp32 expert
BUDGET_GIB = 6 * EXPERT_BYTES * 2 / 2**30  # room for 6 experts in each of the 2 MoE layers

MATH_PRESERVING = [
    dict(residency="static", resident_budget_gib=BUDGET_GIB),
    dict(residency="static", resident_budget_gib=BUDGET_GIB, budget_split="proportional"),
    dict(residency="static", resident_budget_gib=BUDGET_GIB, budget_split="vector", budget_layer_weights="3,1"),
    dict(residency="dynamic", resident_budget_gib=BUDGET_GIB, dynamic_replan_tokens=4, dynamic_halflife_tokens=8),
    dict(residency="cache", resident_budget_gib=BUDGET_GIB, cache_policy="lfu"),
    dict(residency="cache", resident_budget_gib=BUDGET_GIB, prefetch_experts=2),
    dict(residency="static", resident_budget_gib=BUDGET_GIB, missing_expert="fetch"),
    dict(residency="static", resident_budget_gib=BUDGET_GIB, missing_expert="auto"),
    dict(residency="static", resident_budget_gib=0.0),
    dict(expert_batching="micro", micro_batch_tokens=3),
    dict(expert_batching="micro", micro_batch_tokens=1, residency="cache", resident_budget_gib=BUDGET_GIB),
    dict(max_replicas=2, replica_threshold=1.1, replica_window_tokens=4),
    dict(max_replicas=1, replica_threshold=1.5, replica_window_tokens=8, residency="static",
         resident_budget_gib=BUDGET_GIB * 2),
    dict(host_expert_threads=1),
    dict(decode_attention="host"),
]


@pytest.mark.parametrize("knobs", MATH_PRESERVING, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_placement_knobs_do_not_change_the_maths(model_dir, reference, knobs):
    ref_tokens, ref_logits = reference
    eng = Engine(model_dir, EngineConfig().replace(max_batch_seqs=4, **knobs))
    eng.warm_up_hotness(64)
    assert eng.generate(PROMPTS, 6) == ref_tokens
    for p, want in zip(PROMPTS, ref_logits, strict=True):
        torch.testing.assert_close(_logits(eng, p), want, atol=LOGIT_ATOL, rtol=0)
    if eng.model.hybrid is not None:
        eng.model.hybrid.drain()
        budget = eng.config.experts.resident_budget_gib * 2**30
        if eng.config.experts.residency in ("static", "dynamic", "cache") and not knobs.get("max_replicas"):
            assert eng.model.hybrid.fast_bytes() <= budget


def test_static_residency_keeps_the_hottest_and_counts_tiers(model_dir):
    eng = Engine(model_dir, EngineConfig().replace(residency="static", resident_budget_gib=BUDGET_GIB))
    hot = np.zeros((2, 16))
    hot[:, [3, 5, 7]] = 1.0
    hot += 1e-3
    eng.set_hotness(hot / hot.sum(1, keepdims=True))
    table = eng.model.hybrid.expert_table()
    for layer in eng.spec.moe_layers:
        resident = {e for e in range(16) if table[(layer, e)][0]}
        assert {3, 5, 7} <= resident and len(resident) == 6
    eng.generate(PROMPTS, 4)
    st = eng.model.hybrid.stats
    assert st.expert_calls_fast_hi > 0 and st.expert_calls_host > 0


def test_dynamic_residency_promotes_what_became_hot(model_dir):
    eng = Engine(model_dir, EngineConfig().replace(residency="dynamic", resident_budget_gib=BUDGET_GIB / 3,
                                                   dynamic_replan_tokens=8, dynamic_halflife_tokens=16,
                                                   dynamic_hysteresis=0.0))
    cold = np.full((2, 16), 1 / 16)
    eng.set_hotness(cold)
    before = {k for k, v in eng.model.hybrid.expert_table().items() if v[0]}
    hy = eng.model.hybrid
    counts = np.zeros((2, 16))
    counts[:, [14, 15]] = 50
    for _ in range(6):
        hy.observe(counts, 100)
    hy.drain()
    after = {k for k, v in hy.expert_table().items() if v[0]}
    assert after != before and {(layer, 15) for layer in eng.spec.moe_layers} <= after
    assert hy.stats.swaps > 0 and hy.stats.replans > 0


def test_routing_pruning_mirrors_the_reference_policy(model_dir):
    eng = Engine(model_dir, EngineConfig().replace(top_k_override=2, min_gate_weight=0.3))
    lw = eng.model.layers[0]
    h = torch.randn(9, eng.spec.hidden_size)
    w, ids = eng.model.route(lw, h)
    eng.model.top_k_override, eng.model.min_gate_weight = 0, 0.0
    w0, ids0 = eng.model.route(lw, h)
    ref_w, ref_ids, _ = prune_routes(w0.numpy(), ids0.numpy(), top_k_override=2, min_gate_weight=0.3)
    np.testing.assert_allclose(w.numpy(), ref_w, atol=1e-6)
    np.testing.assert_array_equal(ids.numpy(), ref_ids)


def test_routing_changes_are_measured_by_eval(model_dir):
    same = evaluate(Engine(model_dir, EngineConfig().replace(residency="static", resident_budget_gib=BUDGET_GIB)))
    assert same["top1_agreement"] == 1.0 and same["mean_kl"] < 1e-9
    pruned = evaluate(Engine(model_dir, EngineConfig().replace(top_k_override=1)))
    assert pruned["mean_kl"] > 1e-9  # fewer experts: a measured, non-zero change


def test_run_reports_tiers_inert_knobs_and_expert_residency(model_dir):
    eng = Engine(model_dir, EngineConfig().replace(residency="static", resident_budget_gib=BUDGET_GIB))
    wl = Workload("w", [Request(f"r{i}", 0.0, 6 + i, 3) for i in range(4)], {})
    res = run_workload(eng, wl, mode="offline")
    meta = res.meta
    assert meta["hybrid"] is False  # no accelerator: both tiers are host memory
    assert meta["tiers"]["expert_calls_host"] > 0
    assert "execution.expert_sm_share" in meta["inert_knobs"]
    resident = [e for e in res.expert_stats if e.resident]
    assert 0 < len(resident) < len(res.expert_stats)


@pytest.mark.parametrize(
    "knobs, needle",
    [
        (dict(hi_precision="int4", int4_group_size=128), "experts.int4_group_size=128 does not divide"),
        (dict(residency="static", resident_budget_gib=4000.0), "exceeds the fast tier"),
        (dict(residency="static", resident_budget_gib=0.0, max_replicas=1), "replicas need fast-tier budget"),
        (dict(residency="static", budget_split="vector", budget_layer_weights="1,2,3"), "has 3 entries"),
        (dict(top_k_override=40), "routing.top_k_override=40 exceeds"),
    ],
)
def test_bad_hybrid_configs_fail_before_model_work(model_dir, knobs, needle):
    with pytest.raises(ConfigError, match=needle):
        Engine(model_dir, EngineConfig().replace(**knobs))


def test_inert_knobs_without_gpu():
    inert = inert_knobs(has_gpu=False)
    assert "execution.expert_sm_share" in inert and "execution.decode_attention" in inert
    assert "runtime.dense_precision" not in inert
    # With a GPU the model runs there: only the native CPU kernels' knobs are inert.
    assert set(inert_knobs(has_gpu=True)) == {"runtime.dense_precision", "experts.int8_activations"}


def test_a_cpu_fast_tier_version_in_the_hosts_dtype_is_the_host_tensors():
    """On the CPU the fast tier is the host's memory: a version in the stored dtype reads the host's weights
    (no copy at reconfigure); another dtype or an integer precision is a new tensor."""
    from engine.moe.experts import make_version

    w13, w2 = torch.randn(16, 8).bfloat16(), torch.randn(8, 8).bfloat16()
    cpu = torch.device("cpu")
    same = make_version(w13, w2, "bf16", cpu, 32)
    assert same.w13.data_ptr() == w13.data_ptr() and same.w2.data_ptr() == w2.data_ptr()
    wide = make_version(w13, w2, "fp32", cpu, 32)
    assert wide.w13.dtype == torch.float32 and torch.equal(wide.w13, w13.float())
    assert wide.nbytes == 2 * same.nbytes
