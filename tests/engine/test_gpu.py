"""GPU checks: the same engine on CUDA, with real tiers (device memory vs pinned host memory).

Skipped without CUDA; `scripts/gpu_check.sh` runs them with a short knob sweep on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from engine.bench import bench_batch
from engine.config import EngineConfig
from engine.model.maker import make_model
from engine.quality import prompt_logits
from engine.runtime import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [100, 200, 300, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
# fp32 on the GPU (TF32 off) against fp32 on the CPU: different kernels, same arithmetic up to order.
ATOL = 2e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.backends.cuda.matmul.allow_tf32 = False
    d = tmp_path_factory.mktemp("gpu-model")
    make_model(d, "qwen3_moe", "tiny", seed=5, dtype="float32",
               config_overrides=dict(num_experts=16, num_experts_per_tok=4))
    return str(d)


@pytest.fixture(scope="module")
def cpu_reference(model_dir):
    eng = Engine(model_dir, EngineConfig().replace(device="cpu"))
    return eng.generate(PROMPTS, 6), [prompt_logits(eng, p) for p in PROMPTS]


BUDGET = 6 * 3 * 64 * 32 * 4 * 2 / 2**30

def _acted(kind: str):
    """What the tier statistics of a generate call (after start-up) must show for a knob to have acted:
    a knob that silently did nothing leaves them at zero."""
    checks = {
        "host": lambda d: d["expert_calls_host"] > 0 and d["expert_calls_fetched"] == 0,
        "fetch": lambda d: d["expert_calls_fetched"] > 0 and d["bytes_to_fast"] > 0 and d["expert_calls_host"] == 0,
        "auto": lambda d: d["expert_calls_host"] + d["expert_calls_fetched"] > 0,
        "dynamic": lambda d: d["replans"] > 0,
        "cache": lambda d: d["bytes_to_fast"] > 0 and d["prefetched"] > 0,
        "replicas": lambda d: d["replica_calls"] > 0,
        "micro": lambda d: d["expert_calls_fast_hi"] > 0 and d["expert_calls_host"] + d["expert_calls_fetched"] > 0,
    }
    return checks.get(kind)


CASES = [
    ({}, None),
    (dict(residency="static", resident_budget_gib=BUDGET, missing_expert="host"), "host"),
    (dict(residency="static", resident_budget_gib=BUDGET, missing_expert="fetch"), "fetch"),
    (dict(residency="static", resident_budget_gib=BUDGET, missing_expert="auto"), "auto"),
    (dict(residency="dynamic", resident_budget_gib=BUDGET, dynamic_replan_tokens=4), "dynamic"),
    (dict(residency="cache", resident_budget_gib=BUDGET, prefetch_experts=2), "cache"),
    (dict(max_replicas=2, replica_threshold=1.1, replica_window_tokens=4), "replicas"),
    (dict(expert_batching="micro", micro_batch_tokens=3, residency="static", resident_budget_gib=BUDGET), "micro"),
    (dict(decode_attention="host"), "attention"),
    (dict(expert_sm_share=0.5), None),
]


@pytest.mark.parametrize("knobs,kind", CASES,
                         ids=lambda k: (",".join(f"{a}={b}" for a, b in k.items()) or "plain") if isinstance(k, dict) else "")
def test_cuda_matches_cpu(model_dir, cpu_reference, knobs, kind):
    tokens, logits = cpu_reference
    eng = Engine(model_dir, EngineConfig().replace(device="cuda", **knobs))
    eng.warm_up_hotness(64)
    hybrid = eng.model.hybrid
    before = hybrid.stats.as_dict() if hybrid is not None else {}
    assert eng.generate(PROMPTS, 6) == tokens
    check = _acted(kind) if kind else None
    if check is not None:
        hybrid.drain()
        delta = {k: v - before[k] for k, v in hybrid.stats.as_dict().items()}
        assert check(delta), (kind, delta)
    if kind == "attention":
        assert eng.cache.device.type == "cpu" and eng.device.type == "cuda"
    for p, want in zip(PROMPTS, logits, strict=True):
        torch.testing.assert_close(prompt_logits(eng, p), want, atol=ATOL, rtol=0)
    if eng.model.hybrid is not None:
        eng.model.hybrid.drain()
        assert not eng.model.hybrid.inert, eng.model.hybrid.inert  # every knob acted on this GPU


def test_partial_residency_keeps_experts_in_pinned_host_memory(model_dir):
    eng = Engine(model_dir, EngineConfig().replace(device="cuda", residency="static", resident_budget_gib=BUDGET))
    hy = eng.model.hybrid
    some = hy.handles[0][0].host
    assert some.device.type == "cpu" and some.w13.is_pinned()
    assert hy.fast_bytes() <= BUDGET * 2**30
    assert any(h.fast is not None and h.fast.device.type == "cuda" for h in hy.handles[0])


def test_bench_rooflines_use_the_gpus_limits_and_count_the_host_experts(model_dir):
    eng = Engine(model_dir, EngineConfig().replace(device="cuda", residency="static", resident_budget_gib=BUDGET,
                                                   missing_expert="host"))
    eng.warm_up_hotness(64)
    row = bench_batch(eng, 2, 8, 6)
    lim = row["limits"]
    assert lim["device"] == "cuda" and lim["read_gbps"] > lim["host_read_gbps"] and lim["link_gbps"] > 0
    assert row["mem_bw_gb_per_s"] == lim["read_gbps"]
    assert 0 < row["host_weight_bytes_per_decode_step"] < row["weight_bytes_per_decode_step"]
    device_s = (row["bytes_per_decode_step"] - row["host_weight_bytes_per_decode_step"]) / (lim["read_gbps"] * 1e9)
    host_s = row["host_weight_bytes_per_decode_step"] / (lim["host_read_gbps"] * 1e9)
    assert row["bandwidth_roofline_decode_tokens_per_s"] == pytest.approx(2 / max(device_s, host_s))
