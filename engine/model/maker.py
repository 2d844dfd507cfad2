"""Random-weight MoE checkpoints in the Hugging Face layout, for tests, benchmarks and defaults.

Random routers route almost uniformly, which would make every placement policy look useless:
trained MoE models send most tokens to a few hot experts per layer. So the maker gives every token
embedding a shared component along one direction ``u`` and adds ``skew * z_e * u`` to each expert's
router row, with per-layer expert scores ``z_e`` (a seeded permutation of Gaussian quantiles). The
router logit of expert e then carries a layer-dependent offset proportional to z_e, plus
token-dependent noise: a heavy-tailed, layer-dependent popularity that still varies with the input.

Every model also gets a small real tokenizer (:func:`write_tokenizer`): a byte-level BPE
``tokenizer.json`` that covers the whole vocabulary, and a ``tokenizer_config.json`` with a chat
template, so ``engine serve`` takes and returns text for built-in models.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.env import cache_dir
from engine.model.arch import ARCHS, CheckpointError, expected_tensors, router_name, spec_from_config
from engine.precision import FLOAT_PRECISIONS

log = logging.getLogger(__name__)

PRESETS = ("tiny", "small", "medium")
DEFAULT_ROUTER_SKEW = 1.0
_U_SHARE = 0.5  # norm of the shared embedding component relative to the random part
SHARD_BYTES = 1 << 30

# Shapes per preset. "medium" matches the qwen3_moe model the peers were measured on (MACHINE.md).
_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, experts=8, top_k=2, expert_intermediate=32,
                 dense_intermediate=96, shared_intermediate=48),
    "small": dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, experts=32, top_k=4, expert_intermediate=320,
                  dense_intermediate=1024, shared_intermediate=640),
    "medium": dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=64, experts=64, top_k=8, expert_intermediate=384,
                   dense_intermediate=2048, shared_intermediate=1536),
}


def make_config(arch: str, preset: str, **overrides: Any) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict for ``arch`` at ``preset`` size; overrides win."""
    if arch not in ARCHS:
        raise CheckpointError(f"make-model: arch={arch!r}: expected one of {', '.join(ARCHS)}")
    if preset not in PRESETS:
        raise CheckpointError(f"make-model: preset={preset!r}: expected one of {', '.join(PRESETS)}")
    s = _SHAPES[preset]
    cfg: dict[str, Any] = {
        "model_type": arch,
        "architectures": [{"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                           "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}[arch]],
        "vocab_size": s["vocab_size"],
        "hidden_size": s["hidden_size"],
        "num_hidden_layers": s["num_hidden_layers"],
        "num_attention_heads": s["num_attention_heads"],
        "num_key_value_heads": s["num_key_value_heads"],
        "head_dim": s["head_dim"],
        "num_experts_per_tok": s["top_k"],
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6 if arch != "olmoe" else 1e-5,
        "rope_theta": 1e6 if arch != "olmoe" else 10000.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "output_router_logits": False,
    }
    if arch == "mixtral":
        cfg.update(num_local_experts=s["experts"], intermediate_size=s["expert_intermediate"], sliding_window=None)
    elif arch == "olmoe":
        cfg.update(num_experts=s["experts"], intermediate_size=s["expert_intermediate"], norm_topk_prob=False,
                   clip_qkv=None, attention_bias=False)
    else:
        cfg.update(num_experts=s["experts"], moe_intermediate_size=s["expert_intermediate"],
                   intermediate_size=s["dense_intermediate"], decoder_sparse_step=1, mlp_only_layers=[],
                   norm_topk_prob=arch == "qwen3_moe", use_sliding_window=False, sliding_window=None)
        if arch == "qwen2_moe":
            cfg.update(shared_expert_intermediate_size=s["shared_intermediate"], qkv_bias=True)
        else:
            cfg.update(attention_bias=False)
    cfg.update(overrides)
    return cfg


@dataclass
class MadeModel:
    path: Path
    params: int
    bytes: int


def make_model(out: str | Path, arch: str, preset: str = "tiny", *, seed: int = 0, dtype: str = "bfloat16",
               router_skew: float = DEFAULT_ROUTER_SKEW, config_overrides: dict[str, Any] | None = None,
               shard_bytes: int = SHARD_BYTES) -> MadeModel:
    """Write a random-weight checkpoint (config.json + safetensors, sharded with an index when large)."""
    if dtype not in FLOAT_PRECISIONS.values():
        raise CheckpointError(f"make-model: dtype={dtype!r}: expected one of {', '.join(FLOAT_PRECISIONS.values())}")
    torch_dtype = getattr(torch, dtype)
    if router_skew < 0:
        raise CheckpointError(f"make-model: router_skew={router_skew}: must be >= 0")
    cfg = make_config(arch, preset, **(config_overrides or {}))
    cfg["torch_dtype"] = dtype
    spec = spec_from_config(cfg, "make-model")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    std = float(cfg.get("initializer_range", 0.02))
    h = spec.hidden_size

    # The shared direction that carries router skew through the residual stream.
    u = torch.randn(h, generator=gen)
    u /= u.norm()
    names = expected_tensors(spec)
    routers = {router_name(spec, i): i for i in spec.moe_layers}
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_size = [0]
    total_params = 0
    for name, shape in names.items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t = torch.ones(shape)
        elif name == "model.embed_tokens.weight":
            # Unit-variance embeddings keep each token's identity dominant in the residual stream; with
            # small ones, every layer's nearly token-independent attention output would dominate, and
            # the routers of deeper layers would all pick the same experts.
            t = torch.randn(shape, generator=gen)
            if router_skew > 0:
                t += _U_SHARE * math.sqrt(h) * u  # the shared component along u (a fraction of the norm)
        else:
            t = torch.randn(shape, generator=gen) * std
        if name in routers:
            t -= (t @ u)[:, None] * u[None, :]  # no accidental offsets from the shared component
            if router_skew > 0:
                layer = routers[name]
                lg = torch.Generator().manual_seed(seed * 1000 + layer + 1)
                q = (torch.arange(spec.n_experts, dtype=torch.float32) + 0.5) / spec.n_experts
                z = torch.special.ndtri(q)[torch.randperm(spec.n_experts, generator=lg)]  # [E]
                layer_skew = router_skew * (0.6 + 0.8 * torch.rand((), generator=lg).item())
                # x_norm . u = |x| a / sqrt(1+a^2) and the random logit part has std std |x| / sqrt(1+a^2):
                # this offsets expert e's logit by layer_skew * z_e of those standard deviations.
                t += (layer_skew * std / _U_SHARE) * z[:, None] * u[None, :]
        t = t.to(torch_dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if shard_size[-1] and shard_size[-1] + nbytes > shard_bytes:
            shards.append({})
            shard_size.append(0)
        shards[-1][name] = t
        shard_size[-1] += nbytes
        total_params += t.numel()

    for old in list(out.glob("*.safetensors")) + [out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
        index = {"metadata": {"total_size": sum(shard_size)}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg["moetune"] = {"preset": preset, "seed": seed, "router_skew": router_skew, "maker": "engine make-model"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}, indent=2))
    write_tokenizer(out, cfg)
    log.info("wrote %s: %s-%s, %.1fM params", out, arch, preset, total_params / 1e6)
    return MadeModel(out, total_params, sum(shard_size))


def resolve_model(model: str) -> Path:
    """A model path, or ``builtin:<arch>-<preset>`` made once into the cache directory and reused."""
    if not model.startswith("builtin:"):
        return Path(model)
    name = model[len("builtin:"):]
    arch, _, preset = name.rpartition("-")
    if arch not in ARCHS or preset not in PRESETS:
        raise CheckpointError(
            f"{model}: expected builtin:<arch>-<preset> with arch in {', '.join(ARCHS)} "
            f"and preset in {', '.join(PRESETS)}")
    root = cache_dir() / "models"
    path = root / name
    if (path / "config.json").exists() and (path / TOKENIZER_FILE).exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    # Several tuner workers may ask at once: one makes it, the others wait on the lock.
    with (root / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").exists():
            tmp = root / f".{name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            log.info("making %s into %s (once)", model, path)
            make_model(tmp, arch, preset)
            tmp.rename(path)
        elif not (path / TOKENIZER_FILE).exists():
            # Made before the maker wrote tokenizers: add one; the weights (and fingerprint) stay.
            log.info("adding a tokenizer to %s", path)
            write_tokenizer(path, json.loads((path / "config.json").read_text()))
    return path


# ------------------------------------------------------------------------------------ tokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
#: Special tokens by id; pad, bos and eos are the ids :func:`make_config` writes (0, 1, 2).
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
#: Zephyr-style turns, each closed by the end-of-sequence token (which stops generation).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('messages: role must be system, user or assistant, not ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte 0..255."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _syllable_merges(n: int) -> list[tuple[str, str]]:
    """The first ``n`` merges of a generated (not trained) BPE: consonant-vowel syllables, then words
    of one to three syllables after a space ("Ġ" in the byte-level alphabet)."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    merges: list[tuple[str, str]] = [(s[0], s[1]) for s in syllables]
    merges += [("Ġ", s) for s in syllables]
    words = ["Ġ" + s for s in syllables]
    while len(merges) < n:
        longer = []
        for w in words:
            for s in syllables:
                merges.append((w, s))
                longer.append(w + s)
                if len(merges) >= n:
                    return merges[:n]
        words = longer
    return merges[:n]


def write_tokenizer(out: str | Path, cfg: dict[str, Any]) -> bool:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for a made model's vocabulary.

    A byte-level BPE (GPT-2's alphabet) whose merges are generated rather than trained: any text
    encodes, and every id of the vocabulary decodes (mostly to pseudo-words such as " bakotu").
    Returns False, writing nothing, where the vocabulary cannot hold the special tokens and all 256
    bytes or the special ids differ from :func:`make_config`'s.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    out = Path(out)
    vocab_size = int(cfg["vocab_size"])
    base = len(SPECIAL_TOKENS) + 256
    ids = (cfg.get("pad_token_id"), cfg.get("bos_token_id"), cfg.get("eos_token_id"))
    if vocab_size < base or ids != (0, 1, 2):
        log.info("%s: no tokenizer written (vocabulary %d, special ids %s)", out, vocab_size, ids)
        return False
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + b for b, ch in enumerate(_bytes_to_unicode())})
    merges = _syllable_merges(vocab_size - base)
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    tmp = out / f".{TOKENIZER_FILE}.tmp"
    tok.save(str(tmp))
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": None,
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": int(cfg.get("max_position_embeddings", 4096)),
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False}
                                 for i, t in enumerate(SPECIAL_TOKENS)},
    }, indent=2))
    tmp.rename(out / TOKENIZER_FILE)  # last: its presence means the tokenizer is complete
    return True
