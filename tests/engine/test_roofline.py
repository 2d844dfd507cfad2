"""Rooflines against the limits of the device a step runs on (engine/roofline.py).

The accelerator's limits are given here as numbers (this machine has none); tests/engine/test_gpu.py
checks the measured ones on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.model.maker import make_model
from engine.roofline import Limits, StepCost, machine_limits, phase_bytes, roofline, step_cost, tier_shares
from engine.runtime import Engine

GPU = Limits("cuda", read_gbps=3000.0, host_read_gbps=100.0, link_gbps=25.0,
             device_peak_gflops={"bf16": 700e3, "fp16": 700e3, "fp32": 50e3})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("roofline-model")
    make_model(d, "qwen3_moe", "tiny", seed=3)
    return str(d)


def _cost(**kw) -> StepCost:
    base = dict(tokens=1, weight_bytes=450e6, kv_bytes=2e6, flop_dense=1e8, flop_experts=3e8, flop_attention=1e6,
                dense_path="bf16/torch:bf16", expert_path="bf16/torch:bf16", compute_precision="bf16")
    return StepCost(**{**base, **kw})


def test_a_cpu_step_reads_everything_at_the_host_bandwidth():
    cost = _cost(host_weight_bytes=100e6)  # on the CPU, host experts share the one memory
    r = roofline(cost, Limits.host(30.0))
    assert r["bandwidth_roofline_tokens_per_s"] == pytest.approx(30e9 / 452e6)
    assert r["bandwidth_bound_by"] == "memory" and r["limits"]["device"] == "cpu"
    assert roofline(cost, 30.0) == r  # a bare bandwidth is the host's


def test_an_accelerator_step_reads_its_own_memory_not_the_hosts():
    r = roofline(_cost(), GPU)
    assert r["bandwidth_roofline_tokens_per_s"] == pytest.approx(3000e9 / 452e6)
    assert r["bandwidth_bound_by"] == "device memory"
    # Its products are priced at its own peak in the compute precision, not at the host's paths.
    assert r["compute_roofline_tokens_per_s"] == pytest.approx(700e12 / 4.01e8)
    assert r["bound"] == "bandwidth"
    fp32 = roofline(_cost(compute_precision="fp32", dense_path="fp32/torch:fp32"), GPU)
    assert fp32["compute_roofline_tokens_per_s"] == pytest.approx(50e12 / 4.01e8)


@pytest.mark.parametrize(("host_bytes", "link_bytes", "bound_by"),
                         [(40e6, 0.0, "host memory"), (0.0, 50e6, "link"), (1e6, 1e6, "device memory")])
def test_an_accelerator_step_with_missing_experts_is_bound_by_the_slowest_of_its_reads(host_bytes, link_bytes,
                                                                                      bound_by):
    cost = _cost(host_weight_bytes=host_bytes, link_bytes=link_bytes)
    r = roofline(cost, GPU)
    seconds = {"device memory": (452e6 - host_bytes) / 3000e9, "host memory": host_bytes / 100e9,
               "link": link_bytes / 25e9}
    assert r["bandwidth_bound_by"] == bound_by
    assert r["bandwidth_roofline_tokens_per_s"] == pytest.approx(1 / max(seconds.values()))
    assert r["host_weight_bytes_per_step"] == host_bytes and r["link_bytes_per_step"] == link_bytes


def test_tier_shares_are_of_the_span_between_two_counts():
    before = {"expert_calls_fast_hi": 10, "expert_calls_fast_lo": 0, "expert_calls_host": 5,
              "expert_calls_fetched": 0, "bytes_to_fast": 1000}
    after = {"expert_calls_fast_hi": 40, "expert_calls_fast_lo": 10, "expert_calls_host": 25,
             "expert_calls_fetched": 15, "bytes_to_fast": 151000}
    assert tier_shares(before, after) == {"host_call_share": 20 / 75, "fetched_bytes_per_call": 150000 / 75}
    assert tier_shares(after, after) is None  # no calls in between
    assert tier_shares(None, None) is None


def test_step_cost_splits_the_host_experts_bytes_and_flop(model_dir):
    engine = Engine(model_dir, EngineConfig().replace(device="cpu", compute_dtype="float32"))
    plain = step_cost(engine, 4, 3.0, 16.0)
    split = step_cost(engine, 4, 3.0, 16.0, tiers={"host_call_share": 0.25, "fetched_bytes_per_call": 1000.0})
    assert plain.host_weight_bytes == 0 and plain.link_bytes == 0 and plain.host_flop == 0
    assert (split.weight_bytes, split.flop) == (plain.weight_bytes, plain.flop)  # the same step, split by tier
    expert_bytes = plain.weight_bytes - step_cost(engine, 4, 0.0, 16.0).weight_bytes
    assert split.host_weight_bytes == pytest.approx(0.25 * expert_bytes)
    assert split.host_flop == pytest.approx(0.25 * plain.flop_experts)
    calls = len(engine.spec.moe_layers) * 3.0
    assert split.link_bytes == pytest.approx(1000.0 * calls)
    assert split.compute_precision == "fp32"


@pytest.mark.parametrize("arch,overrides,knobs", [
    ("qwen3_moe", {}, {}),  # q/k norms
    ("qwen2_moe", {"mlp_only_layers": [0]}, {"dense_precision": "int8"}),  # shared experts, a dense MLP; int8 copies
    ("mixtral", {}, {"hi_precision": "int8", "kv_dtype": "bfloat16"}),
])
def test_a_steps_phases_read_the_bytes_its_roofline_counts(tmp_path, arch, overrides, knobs):
    """phase_bytes splits a decode step's bytes by the fused step's phases (what decode_profile.py --phases
    sets beside their times): they add up to step_cost's bytes for the same experts and positions, each
    family's own matrices in their phase, in the precision they run in."""
    make_model(tmp_path, arch, "tiny", seed=5, config_overrides=overrides)
    engine = Engine(str(tmp_path), EngineConfig().replace(device="cpu", compute_dtype="float32", **knobs))
    n_moe, tokens, context = len(engine.spec.moe_layers), 3, 40.0
    phases = phase_bytes(engine, 2.5 * n_moe, tokens * context)
    assert sum(phases.values()) == pytest.approx(step_cost(engine, tokens, 2.5, context).bytes)
    m = engine.model
    qkv = [m._q8(lw, "wqkv") or (lw.wqkv,) for lw in m.layers]
    assert phases["qkv"] == sum(t.numel() * t.element_size() for ts in qkv for t in ts) + sum(
        lw.bqkv.numel() * lw.bqkv.element_size() for lw in m.layers if lw.bqkv is not None)
    assert (phases["shared"] > 0, phases["mlp"] > 0) == ((True, True) if arch == "qwen2_moe" else (False, False))
    assert (phases["rope"] > 0) == (arch == "qwen3_moe")
    assert phases["attention"] == tokens * context * engine.spec.kv_bytes_per_token(engine.cache.dtype.itemsize)


def test_machine_limits_on_the_cpu_are_the_hosts():
    lim = machine_limits("cpu")
    assert lim.device == "cpu" and lim.read_gbps == lim.host_read_gbps > 0
    assert lim.link_gbps is None and lim.device_peak_gflops is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_machine_limits_on_cuda_are_the_accelerators():
    lim = machine_limits("cuda")
    assert lim.device == "cuda" and lim.read_gbps > lim.host_read_gbps  # HBM or GDDR against host DRAM
    assert lim.link_gbps > 0 and lim.device_peak_gflops["bf16"] > lim.device_peak_gflops["fp32"] > 0
