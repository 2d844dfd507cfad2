"""GPU checks: the same engine on CUDA, with real tiers (device memory vs pinned host memory).

Skipped without CUDA; `scripts/gpu_check.sh` runs them with a short knob sweep on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

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

CASES = [
    {},
    dict(residency="static", resident_budget_gib=BUDGET, missing_expert="host"),
    dict(residency="static", resident_budget_gib=BUDGET, missing_expert="fetch"),
    dict(residency="static", resident_budget_gib=BUDGET, missing_expert="auto"),
    dict(residency="dynamic", resident_budget_gib=BUDGET, dynamic_replan_tokens=4),
    dict(residency="cache", resident_budget_gib=BUDGET, prefetch_experts=2),
    dict(max_replicas=2, replica_threshold=1.1, replica_window_tokens=4),
    dict(expert_batching="micro", micro_batch_tokens=3, residency="static", resident_budget_gib=BUDGET),
    dict(decode_attention="host"),
    dict(expert_sm_share=0.5),
]


@pytest.mark.parametrize("knobs", CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "plain")
def test_cuda_matches_cpu(model_dir, cpu_reference, knobs):
    tokens, logits = cpu_reference
    eng = Engine(model_dir, EngineConfig().replace(device="cuda", **knobs))
    eng.warm_up_hotness(64)
    assert eng.generate(PROMPTS, 6) == tokens
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
