"""The engine's logits and greedy tokens against Hugging Face transformers on the same checkpoints.

transformers (eager attention, eager experts) is the oracle: it runs each sequence alone in one pass,
without cache or padding, while the engine packs prompts, prompt chunks and decode tokens of several
sequences into shared steps over its KV cache. Skipped when transformers is not installed.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model.arch import ARCHS, CheckpointError

# The maker's default init (std 0.02, unit-variance embeddings) lets the embedding dominate the
# residual stream, so mistakes inside the layers barely move the logits (rope theta +10%: 2e-5).
# Comparisons use weights of std 0.1, where every layer counts (the same mistake: 2e-3).
ORACLE_INIT_STD = 0.1
# fp32: largest |logit| is ~3-4 on these models. The engine sums in other orders than transformers
# (fused qkv, experts batched per step, SDPA vs eager softmax): logits move by ~1e-6, at most 4.2e-7
# of the scale over every test here (measured). A bound of 1e-4 of the scale leaves ~250x headroom,
# and every mistake tried moves them by more: rope theta +10% 5e-4, sliding window off by one 0.1,
# top-k renormalisation flipped 0.07, shared-expert gate shifted 0.1 (all relative to the scale).
FP32_TOL = 1e-4
# bf16: most logits rows of the engine and transformers differ by one bf16 ulp of the largest logit
# (2^-6 at 2-4: ~0.4% of the scale); rarely a router near-tie rounds the other way and one token
# takes another expert (measured up to 3.7% of the scale on one row, and transformers' own bf16 run
# is up to 2.4% away from its fp32 run). So: the mean over rows within 1.5e-2 of the scale (measured
# up to 0.5%; top-k renormalisation flipped gives 3.4%), and every row within 1e-1 (gross errors).
# bf16 noise hides subtle precision slips (an RMSNorm computed in bf16: 0.6% mean): the fp32 tests
# and a review of where the engine casts cover those.
BF16_MEAN_TOL = 1.5e-2
BF16_MAX_TOL = 1e-1
GREEDY_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    """``make_ckpt`` with weights of std ORACLE_INIT_STD: the checkpoints every comparison here uses."""
    return functools.partial(make_ckpt, initializer_range=ORACLE_INIT_STD)


def reference(hf: Any, path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The oracle model, checked to have loaded exactly the checkpoint's tensors (none left random)."""
    model = hf.model(path, dtype)
    info = model.moetune_loading_info
    assert not info["missing_keys"], f"transformers found no tensor for {sorted(info['missing_keys'])[:4]}"
    assert not info["unexpected_keys"], f"transformers ignores {sorted(info['unexpected_keys'])[:4]}"
    assert not info["mismatched_keys"], f"shapes differ: {sorted(info['mismatched_keys'])[:4]}"
    return model


def assert_matches(hf: Any, driver: Any, model: Any, tol: float, mean_tol: float | None = None) -> None:
    """Every logits row within ``tol`` of the logit scale; with ``mean_tol``, their mean error too."""
    errors, scale = hf.row_errors(driver, model)
    bound = max(1.0, scale)
    worst = max(errors)
    assert worst <= tol * bound, f"max |engine - transformers| = {worst:.3g} at logit scale {scale:.3g}"
    if mean_tol is not None:
        mean = sum(errors) / len(errors)
        assert mean <= mean_tol * bound, f"mean row error {mean:.3g} at logit scale {scale:.3g}"


def mixed_batch(driver: Any, prompt_lens: tuple[int, int, int] = (1, 5, 13), join_len: int = 7) -> None:
    """Continuous batching in miniature: three prompts of different lengths prefilled in ONE step, then
    decode steps of all of them together, a fourth sequence joining (its prompt in the same step as
    the others' decode tokens), one leaving and a new one taking its slot (stale cache behind it).

    Slots are assigned out of order so decode steps see both contiguous slot runs (a cache view)
    and scattered ones (a gather).
    """
    a, b, c = (driver.random_prompt(n, seed=10 + i) for i, n in enumerate(prompt_lens))
    driver.admit("a", 2)
    driver.admit("b", 0)
    driver.admit("c", 1)
    driver.step([("a", a), ("b", b), ("c", c)])
    driver.decode(["b", "c", "a"])  # slots 0, 1, 2: contiguous
    driver.decode(["a", "b", "c"])  # slots 2, 0, 1: gathered
    driver.admit("d", 3)
    d = driver.random_prompt(join_len, seed=13)
    driver.step([("a", [driver.next_token("a")]), ("d", d), ("b", [driver.next_token("b")]),
                 ("c", [driver.next_token("c")])])
    driver.decode(["a", "b", "c", "d"])
    driver.release("b")
    driver.admit("e", 0)  # b's slot, b's keys still in the cache
    e = driver.random_prompt(3, seed=14)
    driver.step([("c", [driver.next_token("c")]), ("e", e), ("a", [driver.next_token("a")]),
                 ("d", [driver.next_token("d")])])
    driver.decode(["e", "d", "c", "a"])
    driver.decode(["a", "c", "d", "e"])


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_matches_transformers(arch, ckpt, hf, open_engine):
    path = ckpt(arch)
    model = reference(hf, path)
    driver = open_engine(path)
    mixed_batch(driver)
    assert_matches(hf, driver, model, FP32_TOL)


CHUNKED = [pytest.param(arch, {}, id=arch) for arch in ARCHS] + [
    pytest.param("mixtral", {"sliding_window": 4}, id="mixtral-window4"),
    pytest.param("qwen3_moe", {"use_sliding_window": True, "sliding_window": 6}, id="qwen3_moe-window6"),
]


def chunked_steps(driver: Any) -> None:
    """A 37-token prompt prefilled in chunks of 8 (8+8+8+8+5, logits only after the last) and a 17-token
    one (8+8+1: a one-token last chunk) beside a third sequence decoding in the same steps, then all
    decode."""
    prompts = {"long": driver.random_prompt(37, seed=1), "tail": driver.random_prompt(17, seed=2)}
    chunks = {seq: [p[i: i + 8] for i in range(0, len(p), 8)] for seq, p in prompts.items()}
    driver.admit("other", 0)
    driver.admit("long", 1)
    driver.admit("tail", 2)
    driver.step([("other", driver.random_prompt(3, seed=3))])
    for i in range(len(chunks["long"])):
        step = [("other", [driver.next_token("other")])]
        for seq, parts in chunks.items():
            if i < len(parts):
                step.append((seq, parts[i], i == len(parts) - 1))
        driver.step(step)
    assert list(driver.logits["long"]) == [36] and list(driver.logits["tail"]) == [16]
    for _ in range(3):
        driver.decode(["long", "other", "tail"])


@pytest.mark.parametrize(("arch", "overrides"), CHUNKED)
def test_chunked_prefill_matches_one_shot(arch, overrides, ckpt, hf, open_engine):
    """chunked_steps equal to transformers' one pass over each sequence. The cache starts at 16 positions
    so it grows in the middle of the prompts."""
    path = ckpt(arch, **overrides)
    model = reference(hf, path)
    driver = open_engine(path, initial_len_tokens=16, reserve=False)
    chunked_steps(driver)
    assert not driver.cache.reserved and driver.cache.capacity >= 40
    assert_matches(hf, driver, model, FP32_TOL)


@pytest.mark.parametrize(("arch", "overrides"), CHUNKED)
def test_native_attention_of_prompts_matches_transformers(arch, overrides, ckpt, hf, open_engine, native_kernels):
    """bf16 weights computed in fp32 run on the native kernels, prompts' attention included
    (prefill_attention, with decode_attention for the decode rows of a mixed step). The products are held
    to the fp32 path (weights widened in registers), so the logits stay within fp32 noise of transformers'
    fp32 run of the same weights: prompts prefilled together, a prompt joining decode rows, chunks after
    cached positions, sliding windows. On the default variant and, where it differs, the AVX2 one (its own
    prompt kernel: what an AVX2-only CPU runs)."""
    from engine import kernels

    path = ckpt(arch, dtype="bfloat16", **overrides)
    model = reference(hf, path, torch.float32)
    isas = [kernels.status()["isa"]]
    if "avx2" in kernels.variants()["runnable"] and kernels.attention_kernels()["prompts"] != "avx2":
        isas.append("avx2")
    for isa in isas:
        with kernels.on_variant(isa), kernels.forced_paths(bf16="f32"):
            assert kernels.ops().isa() == isa
            for steps in (mixed_batch, chunked_steps):
                driver = open_engine(path, weight_dtype=torch.bfloat16)
                assert driver.decoder.native
                steps(driver)
                assert_matches(hf, driver, model, FP32_TOL)


def odd_sizes(arch: str) -> dict[str, Any]:
    """Nothing a power of two: 3 query heads over 1 KV head, expert width 37, 5 experts top-3."""
    sizes: dict[str, Any] = {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1,
                             "head_dim": 16, "experts": 5, "top_k": 3, "width": 37}
    if arch in ("qwen2_moe", "qwen3_moe"):
        sizes["intermediate_size"] = 53  # dense MLP width (unused unless a layer is dense)
    if arch == "qwen2_moe":
        sizes["shared_expert_intermediate_size"] = 29
    return sizes


AWKWARD = [
    *(pytest.param(arch, {"top_k": 1}, id=f"{arch}-top1") for arch in ARCHS),
    pytest.param("qwen3_moe", {"experts": 64, "top_k": 8, "width": 16, "hidden_size": 32, "head_dim": 8},
                 id="qwen3_moe-64x8"),
    pytest.param("mixtral", {"experts": 64, "top_k": 8, "width": 16, "hidden_size": 32, "head_dim": 8},
                 id="mixtral-64x8"),
    *(pytest.param(arch, odd_sizes(arch), id=f"{arch}-odd") for arch in ARCHS),
    pytest.param("olmoe", {"num_key_value_heads": 4}, id="olmoe-mha"),
    pytest.param("qwen2_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [1],
                               "norm_topk_prob": True}, id="qwen2_moe-dense-layers-normtopk"),
    pytest.param("qwen2_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [1],
                               "norm_topk_prob": False}, id="qwen2_moe-dense-layers"),
    pytest.param("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [0], "norm_topk_prob": False},
                 id="qwen3_moe-dense-layer-no-normtopk"),
    pytest.param("olmoe", {"clip_qkv": 0.5}, id="olmoe-clip-qkv"),
    pytest.param("olmoe", {"norm_topk_prob": True}, id="olmoe-normtopk"),
    pytest.param("mixtral", {"sliding_window": 4}, id="mixtral-window4"),
    pytest.param("qwen3_moe", {"use_sliding_window": True, "sliding_window": 4}, id="qwen3_moe-window4"),
    pytest.param("qwen3_moe", {"tie_word_embeddings": True}, id="qwen3_moe-tied"),
]


@pytest.mark.parametrize(("arch", "overrides"), AWKWARD)
def test_awkward_shapes_match_transformers(arch, overrides, ckpt, hf, open_engine):
    path = ckpt(arch, **overrides)
    model = reference(hf, path)
    driver = open_engine(path)
    mixed_batch(driver)
    assert_matches(hf, driver, model, FP32_TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_single_token_prompts(arch, ckpt, hf, open_engine):
    """Only one-token prompts: every prefill segment is a single token at position 0."""
    path = ckpt(arch)
    model = reference(hf, path)
    driver = open_engine(path)
    for i, seq in enumerate("xyz"):
        driver.admit(seq, i)
    driver.step([(seq, driver.random_prompt(1, seed=20 + i)) for i, seq in enumerate("xyz")])
    driver.decode(["x", "y", "z"])
    driver.decode(["z", "x", "y"])
    assert_matches(hf, driver, model, FP32_TOL)


def test_qwen2_moe_sliding_window_matches_or_is_refused(ckpt, hf, open_engine, tmp_path):
    """transformers slides the window on Qwen2-MoE only in the layers its config marks
    ``sliding_attention`` (layer_types / max_window_layers); the engine must honour that or refuse."""
    path = tmp_path / "ckpt"
    shutil.copytree(ckpt("qwen2_moe"), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    (path / "config.json").write_text(json.dumps(cfg))
    model = reference(hf, path)
    try:
        driver = open_engine(path)
    except CheckpointError as e:
        assert "sliding" in str(e) and "\n" not in str(e)
        return
    mixed_batch(driver)
    assert_matches(hf, driver, model, FP32_TOL)


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe"])
def test_attention_bias_includes_o_proj(arch, ckpt, hf, open_engine, tmp_path):
    """With ``attention_bias`` true, transformers' Qwen3-MoE and OLMoE have a bias on o_proj too (not
    only q/k/v). A checkpoint carrying non-zero o_proj biases must give transformers' logits."""
    src = ckpt(arch, attention_bias=True)
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    for name in [n for n in tensors if n.endswith("self_attn.o_proj.weight")]:
        tensors[name.replace(".weight", ".bias")] = torch.randn(tensors[name].shape[0], generator=g) * 0.5
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = reference(hf, path)
    driver = open_engine(path)
    mixed_batch(driver)
    assert_matches(hf, driver, model, FP32_TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_generate(arch, ckpt, hf, open_engine):
    """Three prompts decoded greedily together by the engine give transformers' generate() tokens,
    each prompt run alone there (no padding)."""
    path = ckpt(arch)
    model = reference(hf, path)
    driver = open_engine(path)
    prompts = {seq: driver.random_prompt(n, seed=30 + n) for seq, n in (("p", 1), ("q", 6), ("r", 11))}
    for slot, seq in enumerate(prompts):
        driver.admit(seq, slot)
    driver.step(list(prompts.items()))
    for _ in range(GREEDY_NEW_TOKENS - 1):
        driver.decode(list(prompts))
    for seq, prompt in prompts.items():
        engine_tokens = driver.generated(seq, len(prompt)) + [driver.next_token(seq)]
        assert engine_tokens == hf.greedy(model, prompt, GREEDY_NEW_TOKENS), seq


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_match_transformers(arch, ckpt, hf, open_engine):
    """A bf16 checkpoint computed in bf16: the engine's logits are as close to transformers' bf16 run
    and to transformers' fp32 run of the same weights as bf16 rounding allows."""
    path = ckpt(arch, dtype="bfloat16")
    driver = open_engine(path, dtype=torch.bfloat16)
    mixed_batch(driver)
    assert_matches(hf, driver, reference(hf, path, torch.bfloat16), BF16_MAX_TOL, BF16_MEAN_TOL)
    assert_matches(hf, driver, reference(hf, path, torch.float32), BF16_MAX_TOL, BF16_MEAN_TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_runtime_generate_matches_transformers(arch, ckpt, hf):
    """engine.runtime.Engine with continuous batching (2 sequences at a time, so the third joins when
    one finishes) and 4-token prefill chunks gives transformers' greedy tokens for every prompt."""
    from engine import runtime
    from engine.config import EngineConfig

    path = ckpt(arch)
    model = reference(hf, path)
    config = EngineConfig().replace(device="cpu", compute_dtype="float32", max_batch_seqs=2,
                                    prefill_chunk_tokens=4, temperature=0.0)
    engine = runtime.Engine(str(path), config)
    outcomes = []
    run_step = engine.step

    def recorded_step():
        outcomes.append(run_step())
        return outcomes[-1]

    engine.step = recorded_step
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, engine.spec.vocab_size, (n,), generator=g).tolist() for n in (3, 10, 7)]
    got = engine.generate(prompts, max_new_tokens=GREEDY_NEW_TOKENS)
    assert got == [hf.greedy(model, p, GREEDY_NEW_TOKENS) for p in prompts]
    # The premise: at most 2 sequences per step, prompts split into chunks, a prompt joining decoders.
    assert max(o.batch_seqs for o in outcomes) == 2
    assert sum(1 for o in outcomes if o.prefill_tokens) > len(prompts)
    assert any(o.prefill_tokens and o.decode_tokens for o in outcomes)
