"""Checkpoints as transformers writes them: configs of transformers 5 (``save_pretrained`` of the
installed version) and of transformers 4 (hand-written in its spelling), routed experts per expert (the
Hub's layout) or stacked (``save_original_format=False``). Each loads, and the engine's logits and
greedy tokens match the transformers model that wrote it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.model.arch import ARCHS, CheckpointError, spec_from_config
from engine.model.checkpoint import Checkpoint
from engine.quality import prompt_logits
from engine.runtime import Engine

# The same bound as the oracle tests (tests/engine/test_model_vs_hf.py): 1e-4 of the logit scale in
# fp32, where summation order alone moves logits by ~1e-6 of it.
FP32_TOL = 1e-4
PROMPTS = [[3, 17, 5, 99, 42, 7, 8, 64, 11], [120, 4], [9] * 13]

# Each family with the options that change its config's spelling or its forward pass.
FAMILY = {
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[1], tie_word_embeddings=True),
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=48, shared_expert_intermediate_size=40,
                      norm_topk_prob=False),
    "mixtral": dict(num_local_experts=8, sliding_window=6),
    "olmoe": dict(num_experts=8, clip_qkv=3.0, norm_topk_prob=False),
}


def hf_config(transformers: Any, arch: str) -> Any:
    return transformers.AutoConfig.for_model(
        arch, vocab_size=160, hidden_size=64, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2, initializer_range=0.1, max_position_embeddings=256,
        eos_token_id=1, bos_token_id=0, pad_token_id=0, **FAMILY[arch])


@pytest.fixture(scope="module")
def written(hf, tmp_path_factory) -> dict[tuple[str, str], tuple[Path, Any]]:
    """(arch, layout) -> (checkpoint directory written by transformers' save_pretrained, the model)."""
    tf = hf.transformers
    out = {}
    for i, arch in enumerate(ARCHS):
        torch.manual_seed(100 + i)
        model = tf.AutoModelForCausalLM.from_config(hf_config(tf, arch), attn_implementation="eager")
        model.eval()
        model.generation_config.eos_token_id = None
        for layout, original in (("per_expert", True), ("fused", False)):
            path = tmp_path_factory.mktemp(f"tf-{arch}-{layout}")
            model.save_pretrained(path, save_original_format=original)
            out[(arch, layout)] = (path, model)
    return out


def as_transformers_4(path: Path, dst: Path) -> Path:
    """The same checkpoint with a config.json in transformers 4's spelling."""
    dst.mkdir()
    cfg = json.loads((path / "config.json").read_text())
    if cfg["model_type"] != "mixtral" and "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
    rope = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rope.get("rope_theta", 10000.0)
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    cfg.pop("layer_types", None)
    cfg["transformers_version"] = "4.51.3"
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in path.glob("*.safetensors*"):
        (dst / f.name).symlink_to(f)
    return dst


def engine_of(path: Path) -> Engine:
    return Engine(path, EngineConfig().replace(device="cpu", compute_dtype="float32", max_batch_seqs=3,
                                                prefill_chunk_tokens=4))


def assert_same_as(engine: Engine, model: Any) -> None:
    for prompt in PROMPTS:
        with torch.inference_mode():
            ref = model(torch.tensor([prompt])).logits[0].float()
        got = prompt_logits(engine, prompt)
        scale = float(ref.abs().max())
        assert float((got - ref).abs().max()) <= FP32_TOL * scale, prompt


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_5_save_pretrained_loads_and_matches(arch, layout, written):
    path, model = written[(arch, layout)]
    cfg = json.loads((path / "config.json").read_text())
    assert "transformers_version" in cfg and cfg["transformers_version"].startswith("5")
    ckpt = Checkpoint(path)
    assert ckpt.layout == layout
    assert ckpt.spec.n_experts == 8 and ckpt.spec.top_k == 2
    engine = engine_of(path)
    assert_same_as(engine, model)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_4_config_loads_the_same_model(arch, written, tmp_path):
    path, model = written[(arch, "per_expert")]
    old = as_transformers_4(path, tmp_path / "tf4")
    assert Checkpoint(old).spec == Checkpoint(path).spec
    assert_same_as(engine_of(old), model)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_qwen3_moe_saved_by_transformers_5_generates_transformers_greedy_tokens(layout, written):
    path, model = written[("qwen3_moe", layout)]
    engine = engine_of(path)
    got = engine.generate(PROMPTS, 8)
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=0,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == ref


# ---------------------------------------------------------------------------------- spellings
BASE = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "intermediate_size": 24}


@pytest.mark.parametrize("experts", [{"num_experts": 6}, {"num_local_experts": 6},
                                     {"num_experts": 6, "num_local_experts": 6}])
def test_either_spelling_of_the_expert_count(experts):
    assert spec_from_config({**BASE, **experts}).n_experts == 6


def test_two_spellings_that_disagree_are_refused():
    with pytest.raises(CheckpointError, match="'num_experts'=6 disagrees with 'num_local_experts'=8"):
        spec_from_config({**BASE, "num_experts": 6, "num_local_experts": 8})


def test_missing_expert_count_names_both_spellings():
    with pytest.raises(CheckpointError, match="missing field 'num_experts' \\(or 'num_local_experts'\\)"):
        spec_from_config(BASE)


@pytest.mark.parametrize("rope,theta", [
    ({"rope_theta": 5e5}, 5e5),
    ({"rope_parameters": {"rope_theta": 2e4, "rope_type": "default"}}, 2e4),
    ({"rope_parameters": {"full_attention": {"rope_theta": 3e4, "rope_type": "default"}}}, 3e4),
    ({"rope_theta": 7e4, "rope_scaling": {"type": "default"}}, 7e4),
])
def test_rope_base_in_every_spelling(rope, theta):
    assert spec_from_config({**BASE, "num_experts": 4, **rope}).rope_theta == theta


@pytest.mark.parametrize("bad,field", [
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn"}}, "rope_type"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e4}, "sliding_attention": {"rope_theta": 1e6}}},
     "rope_parameters"),
    ({"rope_theta": "big"}, "rope_theta"),
    ({"use_sliding_window": True, "sliding_window": -3}, "sliding_window"),
])
def test_bad_rope_and_window_fields_are_one_line_errors(bad, field):
    with pytest.raises(CheckpointError) as info:
        spec_from_config({**BASE, "num_experts": 4, **bad}, "m/config.json")
    assert f"'{field}'" in str(info.value) and str(info.value).startswith("m/config.json") and "\n" not in str(info.value)


def test_a_layer_stored_in_the_other_layout_is_refused(written, tmp_path):
    """A checkpoint mixing layouts (first layer fused, another per expert) names the tensor it misses."""
    from safetensors.torch import load_file, save_file

    path, _ = written[("olmoe", "fused")]
    dst = tmp_path / "mixed"
    dst.mkdir()
    (dst / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    stacked = tensors.pop("model.layers.2.mlp.experts.gate_up_proj")
    for e in range(stacked.shape[0]):
        tensors[f"model.layers.2.mlp.experts.{e}.gate_proj.weight"] = stacked[e, :56].clone()
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing tensor model.layers.2.mlp.experts.gate_up_proj"):
        Checkpoint(dst)
