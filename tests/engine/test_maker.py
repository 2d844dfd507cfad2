"""The model maker: preset sizes, reproducible seeds, and router skew that shows up in routing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from engine.model.arch import ARCHS, CheckpointError, spec_from_config
from engine.model.checkpoint import Checkpoint
from engine.model.maker import DEFAULT_ROUTER_SKEW, make_config, make_model, resolve_model

# Router skew is measured on 512 random tokens: 8 sequences of 64, prefilled in one step.
SKEW_SEQS, SKEW_SEQ_TOKENS = 8, 64
SKEW_EXPERTS, SKEW_TOP_K = 32, 4
HOT_FRACTION = 0.1  # "hot" experts: the top 10% by routed tokens (3 of 32)
# Uniform routing would give the hot 3 of 32 experts 3/32 = 9.4% of the routed tokens (~13% with the
# sampling noise of 2048 choices; measured 12-14.4%). The default skew gives them 35-51% (measured:
# 3 seeds x 3 families x 4 layers), and layers' counts correlate at most 0.43.
SKEWED_MIN_HOT_SHARE = 0.25
UNSKEWED_MAX_HOT_SHARE = 0.20


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_preset_params(arch, tmp_path):
    made = make_model(tmp_path, arch, "tiny", dtype="float32")
    spec = Checkpoint(tmp_path).spec
    stored = load_file(tmp_path / "model.safetensors")
    assert made.params == spec.total_params() == sum(t.numel() for t in stored.values())
    assert made.bytes == 4 * made.params
    assert 50_000 < made.params < 1_000_000


@pytest.mark.parametrize("arch", ARCHS)
def test_total_params_counts_what_transformers_builds(arch, make_ckpt, hf):
    """ModelSpec.total_params (what size reports and the simulator use) equals transformers' count."""
    for overrides in ({}, {"tie_word_embeddings": True, "num_hidden_layers": 3}):
        path = make_ckpt(arch, **overrides)
        assert hf.model(path).num_parameters() == Checkpoint(path).spec.total_params()


@pytest.mark.parametrize("arch", ARCHS)
def test_small_and_medium_presets(arch):
    small = spec_from_config(make_config(arch, "small"))
    medium = spec_from_config(make_config(arch, "medium"))
    assert 100e6 <= small.total_params() <= 200e6
    assert 1.0e9 <= medium.total_params() <= 1.5e9
    assert (medium.n_experts, medium.top_k) == (64, 8)
    assert medium.n_kv_heads < medium.n_heads  # GQA
    assert medium.active_params_per_token() < medium.total_params() / 3


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"arch": "llama"}, "arch"),
    ({"preset": "huge"}, "preset"),
    ({"dtype": "float64"}, "dtype"),
    ({"router_skew": -1.0}, "router_skew"),
])
def test_bad_arguments(kwargs, field, tmp_path):
    args = {"arch": "qwen3_moe", "preset": "tiny", **kwargs}
    with pytest.raises(CheckpointError) as info:
        make_model(tmp_path, args.pop("arch"), args.pop("preset"), **args)
    assert "\n" not in str(info.value) and field in str(info.value)


def test_same_seed_same_files(tmp_path):
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        make_model(tmp_path / name, "qwen2_moe", "tiny", seed=seed)
    files = ("model.safetensors", "config.json")
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    a, c = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "c" / "model.safetensors")
    assert a.keys() == c.keys()
    assert not any(torch.equal(a[n], c[n]) for n in a if not n.endswith("norm.weight"))


def routed_counts(make_ckpt, open_engine, arch: str, seed: int, router_skew: float | None) -> dict[int, torch.Tensor]:
    """Tokens routed to each expert in each MoE layer (MoEDecoder.stats) for 512 random tokens."""
    path = make_ckpt(arch, seed=seed, router_skew=router_skew, experts=SKEW_EXPERTS, top_k=SKEW_TOP_K,
                     hidden_size=128, num_hidden_layers=4)
    driver = open_engine(path, n_slots=SKEW_SEQS)
    for i in range(SKEW_SEQS):
        driver.admit(f"s{i}", i)
    driver.step([(f"s{i}", driver.random_prompt(SKEW_SEQ_TOKENS, seed=100 + i), False) for i in range(SKEW_SEQS)])
    counts = {layer: torch.as_tensor(c) for layer, c in driver.decoder.stats.counts.items()}  # numpy [E] each
    assert sorted(counts) == [0, 1, 2, 3]
    for c in counts.values():
        assert c.shape == (SKEW_EXPERTS,) and int(c.sum()) == SKEW_SEQS * SKEW_SEQ_TOKENS * SKEW_TOP_K
    return counts


def hot_share(counts: torch.Tensor) -> float:
    n_hot = round(HOT_FRACTION * counts.numel())
    return (counts.sort(descending=True).values[:n_hot].sum() / counts.sum()).item()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("seed", [0, 1])
def test_default_router_skew_is_heavy_tailed_and_layer_dependent(arch, seed, make_ckpt, open_engine):
    counts = routed_counts(make_ckpt, open_engine, arch, seed, None)
    shares = {layer: hot_share(c) for layer, c in counts.items()}
    assert min(shares.values()) > SKEWED_MIN_HOT_SHARE, shares
    # Each layer has its own hot set: popularity is not one ranking repeated down the stack.
    by_layer = torch.stack([counts[layer].float() for layer in sorted(counts)])
    corr = torch.corrcoef(by_layer) - torch.eye(len(counts))
    assert corr.max() < 0.8, corr
    n_hot = round(HOT_FRACTION * SKEW_EXPERTS)
    hot_sets = {tuple(sorted(c.argsort(descending=True)[:n_hot].tolist())) for c in counts.values()}
    assert len(hot_sets) == len(counts)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_zero_router_skew_is_near_uniform(arch, make_ckpt, open_engine):
    counts = routed_counts(make_ckpt, open_engine, arch, 0, 0.0)
    shares = {layer: hot_share(c) for layer, c in counts.items()}
    assert max(shares.values()) < UNSKEWED_MAX_HOT_SHARE, shares


def test_router_skew_recorded_and_seeded(make_ckpt):
    path = make_ckpt("olmoe", seed=3)
    assert json.loads((path / "config.json").read_text())["moetune"] == {
        "preset": "tiny", "seed": 3, "router_skew": DEFAULT_ROUTER_SKEW, "maker": "engine make-model"}


def test_builtin_model_made_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETUNE_CACHE", str(tmp_path))
    path = resolve_model("builtin:olmoe-tiny")
    assert path.parent == tmp_path / "models"
    weights = path / "model.safetensors"
    made_ns = weights.stat().st_mtime_ns
    assert Checkpoint(path).spec.arch == "olmoe"
    assert resolve_model("builtin:olmoe-tiny") == path
    assert weights.stat().st_mtime_ns == made_ns
    with pytest.raises(CheckpointError) as info:
        resolve_model("builtin:olmoe-huge")
    assert "\n" not in str(info.value) and "builtin:olmoe-huge" in str(info.value)
