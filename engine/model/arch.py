"""Model families: one normalised description (ModelSpec) of the four MoE decoders moetune runs.

Hugging Face ``config.json`` files name the same things differently per family; everything the
runtime needs is read here, once, and checked. Tensor names follow the Hugging Face layout of the
checkpoints on the Hub (per-expert tensors).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
#: How a checkpoint stores routed experts: one tensor per expert and projection (the Hub's layout, which
#: transformers 4 and 5 write by default), or stacked per layer as transformers 5 holds them in memory
#: (``save_pretrained(..., save_original_format=False)``): ``mlp.experts.gate_up_proj`` [E, 2I, H] with
#: the gate rows first, and ``mlp.experts.down_proj`` [E, H, I].
LAYOUTS = ("per_expert", "fused")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message is one line naming the file and tensor or field."""


DENSE_INT8_GROUP = 32
"""Weights per scale of the int8 copies runtime.dense_precision=int8 makes (llama.cpp's q8_0 keeps one per 32):
against one scale a row, two thirds of the KL on the medium preset (`engine eval`: 3.6e-5 against 5.5e-5,
q8_0's 4.2e-5), for 4 bytes per 32 weights."""


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and options of one MoE decoder, normalised across families."""

    arch: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    expert_intermediate: int
    norm_topk_prob: bool
    rms_eps: float
    rope_theta: float
    tie_word_embeddings: bool = False
    dense_intermediate: int = 0  # width of dense MLP layers (qwen2/3 mlp_only_layers, sparse step)
    shared_expert_intermediate: int = 0  # qwen2_moe shared expert; 0 = none
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"  # "none" | "head" (qwen3: per-head RMSNorm) | "full" (olmoe: over the projection)
    clip_qkv: float | None = None
    sliding_window: int | None = None
    moe_layers: tuple[int, ...] = field(default=())
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    max_position_embeddings: int = 32768

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    # ---- what the model costs (nanochat-style: the model can tell its own costs)
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.expert_intermediate

    def layer_dense_params(self, layer: int) -> int:
        """Parameters of one layer that every token touches (attention, norms, router, dense MLP)."""
        h = self.hidden_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        n = attn + 2 * h
        if self.qkv_bias:
            n += self.q_size + 2 * self.kv_size
        if self.o_bias:
            n += h
        if self.qk_norm == "head":
            n += 2 * self.head_dim
        elif self.qk_norm == "full":
            n += self.q_size + self.kv_size
        if self.is_moe_layer(layer):
            n += h * self.n_experts
            if self.shared_expert_intermediate:
                n += 3 * h * self.shared_expert_intermediate + h
        else:
            n += 3 * h * self.dense_intermediate
        return n

    def int8_dense_bytes(self) -> int:
        """Bytes of the int8 copies runtime.dense_precision=int8 keeps beside the loaded weights: the attention
        projections, dense and shared MLPs and the lm head, one byte a weight and an fp32 scale per
        :data:`DENSE_INT8_GROUP` weights of a row (a bf16 scale a row where the group does not divide it);
        norms, routers and the shared-expert gate stay as loaded."""
        h = self.hidden_size
        mats = [(self.vocab_size, h)]  # [rows, inner]
        for layer in range(self.n_layers):
            mats += [(self.q_size + 2 * self.kv_size, h), (h, self.q_size)]
            inter = (self.shared_expert_intermediate if self.is_moe_layer(layer) else self.dense_intermediate) or 0
            if inter:
                mats += [(2 * inter, h), (h, inter)]
        return sum(rows * (inner + (4 * inner // DENSE_INT8_GROUP if inner % DENSE_INT8_GROUP == 0 else 2))
                   for rows, inner in mats)

    def total_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        layers = sum(self.layer_dense_params(i) for i in range(self.n_layers))
        return embed + head + layers + len(self.moe_layers) * self.n_experts * self.expert_params() + self.hidden_size

    def active_params_per_token(self) -> int:
        """Parameters one token's forward pass multiplies with (lm head included, embedding excluded)."""
        layers = sum(self.layer_dense_params(i) for i in range(self.n_layers))
        return layers + len(self.moe_layers) * self.top_k * self.expert_params() + self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.n_layers * self.kv_size * dtype_bytes

    def weight_bytes_touched(self, n_tokens: int, dtype_bytes: int, experts_touched: float | None = None) -> float:
        """Bytes of weights one forward step reads when it carries ``n_tokens`` decoding tokens.

        ``experts_touched`` is the mean number of distinct experts per MoE layer the step runs; when
        not given it is the expectation under uniform routing, E * (1 - (1 - k/E)^n).
        """
        e, k = self.n_experts, self.top_k
        if experts_touched is None:
            experts_touched = e * (1.0 - (1.0 - k / e) ** n_tokens)
        dense = sum(self.layer_dense_params(i) for i in range(self.n_layers))
        dense += self.vocab_size * self.hidden_size  # lm head
        experts = len(self.moe_layers) * experts_touched * self.expert_params()
        return (dense + experts) * dtype_bytes

    def identity(self, fingerprint: str) -> dict[str, Any]:
        """What a router trace or an exported config is tied to."""
        return {"arch": self.arch, "n_layers": self.n_layers, "moe_layers": list(self.moe_layers),
                "n_experts": self.n_experts, "top_k": self.top_k, "hidden_size": self.hidden_size,
                "fingerprint": fingerprint}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _need(cfg: dict[str, Any], key: str, source: str, kind: type = int) -> Any:
    if key not in cfg or cfg[key] is None:
        raise CheckpointError(f"{source}: missing field '{key}'")
    value = cfg[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise CheckpointError(f"{source}: field '{key}'={value!r}: expected a positive integer")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise CheckpointError(f"{source}: field '{key}'={value!r}: expected a positive number")
    return value


def _need_one(cfg: dict[str, Any], keys: tuple[str, ...], source: str) -> int:
    """A positive integer stored under any of ``keys`` (the spellings of different transformers versions);
    two spellings present with different values are refused."""
    present = [k for k in keys if cfg.get(k) is not None]
    if not present:
        raise CheckpointError(f"{source}: missing field '{keys[0]}'"
                              + (f" (or {', '.join(repr(k) for k in keys[1:])})" if len(keys) > 1 else ""))
    values = {k: _need(cfg, k, source) for k in present}
    if len(set(values.values())) > 1:
        a, b = present[:2]
        raise CheckpointError(f"{source}: field '{a}'={values[a]!r} disagrees with '{b}'={values[b]!r}")
    return values[present[0]]


def _rope(cfg: dict[str, Any], arch: str, source: str) -> float:
    """RoPE base from transformers 5's ``rope_parameters`` (flat, or per attention type) or transformers 4's
    ``rope_theta`` / ``rope_scaling``; only default (unscaled) RoPE is supported."""
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{source}: field 'rope_parameters'={rope!r}: expected an object")
    if rope and "rope_theta" not in rope and "rope_type" not in rope:  # keyed by layer type
        kinds = {k: v for k, v in rope.items() if isinstance(v, dict)}
        if len({json.dumps(v, sort_keys=True) for v in kinds.values()}) > 1:
            raise CheckpointError(f"{source}: field 'rope_parameters' differs between layer types "
                                  f"({', '.join(kinds)}): not supported")
        rope = next(iter(kinds.values()), {})
    rope_scaling = cfg.get("rope_scaling") or {}
    if not isinstance(rope_scaling, dict):
        raise CheckpointError(f"{source}: field 'rope_scaling'={rope_scaling!r}: expected an object")
    rope_type = rope.get("rope_type") or rope_scaling.get("rope_type") or rope_scaling.get("type")
    if rope_type not in (None, "default"):
        raise CheckpointError(f"{source}: field 'rope_type'={rope_type!r}: only default RoPE is supported")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0 if arch == "olmoe" else 1e6))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise CheckpointError(f"{source}: field 'rope_theta'={theta!r}: expected a positive number")
    return float(theta)


def spec_from_config(cfg: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """Normalise a Hugging Face ``config.json`` dict of one of the four families, as transformers 4 or 5
    writes it (``num_experts`` / ``num_local_experts``, ``rope_theta`` / ``rope_parameters``,
    ``torch_dtype`` / ``dtype``: the tensors' own dtypes are what the engine reads)."""
    arch = cfg.get("model_type")
    if arch not in ARCHS:
        raise CheckpointError(
            f"{source}: field 'model_type'={arch!r}: unsupported (supported: {', '.join(ARCHS)})")
    hidden = _need(cfg, "hidden_size", source)
    n_layers = _need(cfg, "num_hidden_layers", source)
    n_heads = _need(cfg, "num_attention_heads", source)
    n_kv = cfg.get("num_key_value_heads") or n_heads
    head_dim = cfg.get("head_dim") or hidden // n_heads
    if n_heads % n_kv:
        raise CheckpointError(
            f"{source}: field 'num_key_value_heads'={n_kv}: does not divide num_attention_heads={n_heads}")
    # transformers 4 writes num_experts for the Qwen families and OLMoE; transformers 5 may write
    # num_local_experts for all of them (Mixtral's own spelling).
    n_experts = _need_one(cfg, ("num_local_experts",) if arch == "mixtral" else ("num_experts", "num_local_experts"),
                          source)
    expert_inter = _need(cfg, "moe_intermediate_size" if arch in ("qwen2_moe", "qwen3_moe") else "intermediate_size",
                         source)
    top_k = _need(cfg, "num_experts_per_tok", source)
    if top_k > n_experts:
        raise CheckpointError(f"{source}: field 'num_experts_per_tok'={top_k}: more than the {n_experts} experts")
    rope_theta = _rope(cfg, arch, source)
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: field 'hidden_act'={cfg.get('hidden_act')!r}: only silu is supported")
    if arch in ("qwen2_moe", "qwen3_moe"):
        step = cfg.get("decoder_sparse_step", 1) or 1
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        moe_layers = tuple(i for i in range(n_layers) if i not in mlp_only and (i + 1) % step == 0)
    else:
        moe_layers = tuple(range(n_layers))
    dense_inter = cfg.get("intermediate_size", 0) if arch in ("qwen2_moe", "qwen3_moe") else 0
    if len(moe_layers) < n_layers and not dense_inter:
        raise CheckpointError(f"{source}: field 'intermediate_size' is needed for the dense MLP layers")
    sliding = None
    if arch == "mixtral" or (arch == "qwen3_moe" and cfg.get("use_sliding_window")):
        sliding = cfg.get("sliding_window")
    elif arch == "qwen2_moe" and cfg.get("use_sliding_window"):
        # Qwen2-MoE's window applies to a per-layer subset that differs between transformers versions
        # (max_window_layers, layer_types); no released Qwen2-MoE checkpoint turns it on.
        raise CheckpointError(f"{source}: field 'use_sliding_window'=true: not supported for {arch}")
    if sliding is not None and (isinstance(sliding, bool) or not isinstance(sliding, int) or sliding <= 0):
        raise CheckpointError(f"{source}: field 'sliding_window'={sliding!r}: expected a positive integer or null")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelSpec(
        arch=arch,
        vocab_size=_need(cfg, "vocab_size", source),
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        n_experts=n_experts,
        top_k=top_k,
        expert_intermediate=expert_inter,
        # Mixtral always renormalises its top-k weights; the others say so in the config.
        norm_topk_prob=True if arch == "mixtral" else bool(cfg.get("norm_topk_prob", False)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6 if arch != "olmoe" else 1e-5)),
        rope_theta=rope_theta,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dense_intermediate=int(dense_inter or 0),
        shared_expert_intermediate=int(cfg.get("shared_expert_intermediate_size", 0) or 0)
        if arch == "qwen2_moe" else 0,
        qkv_bias=bool(cfg.get("qkv_bias", True)) if arch == "qwen2_moe"
        else bool(cfg.get("attention_bias", False)),
        o_bias=arch in ("qwen3_moe", "olmoe") and bool(cfg.get("attention_bias", False)),
        qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(arch, "none"),
        clip_qkv=cfg.get("clip_qkv") if arch == "olmoe" else None,
        sliding_window=sliding,
        moe_layers=moe_layers,
        eos_token_ids=eos_ids,
        bos_token_id=cfg.get("bos_token_id"),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
    )


def expected_tensors(spec: ModelSpec, layout: str = "per_expert") -> dict[str, tuple[int, ...]]:
    """Every tensor name of the Hugging Face layout (routed experts stored as ``layout``) with its shape."""
    h, v = spec.hidden_size, spec.vocab_size
    t: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        t["lm_head.weight"] = (v, h)
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = (h,)
        t[p + "post_attention_layernorm.weight"] = (h,)
        a = p + "self_attn."
        t[a + "q_proj.weight"] = (spec.q_size, h)
        t[a + "k_proj.weight"] = (spec.kv_size, h)
        t[a + "v_proj.weight"] = (spec.kv_size, h)
        t[a + "o_proj.weight"] = (h, spec.q_size)
        if spec.qkv_bias:
            t[a + "q_proj.bias"] = (spec.q_size,)
            t[a + "k_proj.bias"] = (spec.kv_size,)
            t[a + "v_proj.bias"] = (spec.kv_size,)
        if spec.o_bias:
            t[a + "o_proj.bias"] = (h,)
        if spec.qk_norm == "head":
            t[a + "q_norm.weight"] = (spec.head_dim,)
            t[a + "k_norm.weight"] = (spec.head_dim,)
        elif spec.qk_norm == "full":
            t[a + "q_norm.weight"] = (spec.q_size,)
            t[a + "k_norm.weight"] = (spec.kv_size,)
        if not spec.is_moe_layer(i):
            for name, shape in (("gate_proj", (spec.dense_intermediate, h)), ("up_proj", (spec.dense_intermediate, h)),
                                ("down_proj", (h, spec.dense_intermediate))):
                t[f"{p}mlp.{name}.weight"] = shape
            continue
        t[router_name(spec, i, layout)] = (spec.n_experts, h)
        if layout == "fused":
            t.update(fused_expert_names(spec, i))
        else:
            for e in range(spec.n_experts):
                t.update(expert_tensor_names(spec, i, e))
        if spec.shared_expert_intermediate:
            s = spec.shared_expert_intermediate
            t[p + "mlp.shared_expert.gate_proj.weight"] = (s, h)
            t[p + "mlp.shared_expert.up_proj.weight"] = (s, h)
            t[p + "mlp.shared_expert.down_proj.weight"] = (h, s)
            t[p + "mlp.shared_expert_gate.weight"] = (1, h)
    return t


def router_name(spec: ModelSpec, layer: int, layout: str = "per_expert") -> str:
    block = "block_sparse_moe" if spec.arch == "mixtral" and layout == "per_expert" else "mlp"
    return f"model.layers.{layer}.{block}.gate.weight"


def fused_expert_names(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Names of one layer's stacked expert tensors (gate+up, down) in the fused layout, with shapes."""
    h, i, e = spec.hidden_size, spec.expert_intermediate, spec.n_experts
    p = f"model.layers.{layer}.mlp.experts."
    return {p + "gate_up_proj": (e, 2 * i, h), p + "down_proj": (e, h, i)}


def expert_tensor_names(spec: ModelSpec, layer: int, expert: int) -> dict[str, tuple[int, ...]]:
    """Names of one expert's (gate, up, down) tensors, in that order, with shapes."""
    h, i = spec.hidden_size, spec.expert_intermediate
    if spec.arch == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
        return {p + "w1.weight": (i, h), p + "w3.weight": (i, h), p + "w2.weight": (h, i)}
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return {p + "gate_proj.weight": (i, h), p + "up_proj.weight": (i, h), p + "down_proj.weight": (h, i)}


def read_config(model_dir: Path) -> tuple[dict[str, Any], ModelSpec]:
    path = model_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json in the model directory") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return cfg, spec_from_config(cfg, str(path))


def config_fingerprint(cfg: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]
