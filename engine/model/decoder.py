"""The decoder runtime: one forward pass over a flattened batch of prompt chunks and decode tokens.

Every step runs all of its tokens (from any number of sequences, prefill or decode) through the
dense parts and the experts as one matrix per weight: an expert sees every token routed to it in the
step in one product (coalesced execution). Attention is the only per-sequence part: decode tokens
attend in one batched call over the KV cache, prompt chunks one call per chunk.

Shapes: T tokens in the step, H hidden, E experts, K top-k, I expert width, S sequences.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine import kernels
from engine.model.arch import DENSE_INT8_GROUP, ModelSpec
from engine.model.checkpoint import Checkpoint
from engine.moe.experts import Grouped
from engine.moe.policy.controller import PlanSettings, ResidencyController
from engine.moe.policy.plan import DecisionLog, MoEStats
from engine.moe.policy.routing import prune_routes
from engine.precision import precision_of
from engine.sequences import Segment

__all__ = ["KVCache", "LayerWeights", "MoEDecoder", "MoEStats", "RouteRecord", "Segment", "StepBatch", "rms_norm"]

log = logging.getLogger(__name__)

_CACHE_SERIALS = itertools.count(1)


@dataclass
class StepBatch:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    segments: list[Segment]
    all_logits: bool = False  # logits for every token (quality evaluation), not only segment ends

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass
class RouteRecord:
    """Expert choices of one MoE layer for every token of a step (for router traces)."""

    layer: int
    expert_ids: torch.Tensor  # [T, K] int64
    gate_weights: torch.Tensor  # [T, K] float32


@dataclass
class LayerWeights:
    ln1: torch.Tensor
    ln2: torch.Tensor
    wqkv: torch.Tensor  # [Q + 2 KV, H]
    bqkv: torch.Tensor | None
    wo: torch.Tensor  # [H, Q]
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    bo: torch.Tensor | None = None
    # MoE layers
    router: torch.Tensor | None = None  # [E, H]
    w13: torch.Tensor | None = None  # [E, 2I, H] gate rows then up rows
    w2: torch.Tensor | None = None  # [E, H, I]
    shared_w13: torch.Tensor | None = None  # [2S, H]
    shared_w2: torch.Tensor | None = None  # [H, S]
    shared_gate: torch.Tensor | None = None  # [1, H]
    # dense MLP layers
    mlp_w13: torch.Tensor | None = None  # [2D, H]
    mlp_w2: torch.Tensor | None = None  # [H, D]
    # int8 copies of the dense matrices above with their scales (fp32 per DENSE_INT8_GROUP weights of a row; a
    # row's where the group does not divide it), by attribute name (``wqkv``, ``wo``,
    # ``mlp_w13``, ...): made on the first runtime.dense_precision=int8 and kept (MoEDecoder.set_dense_precision)
    int8: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None


#: The dense matrices runtime.dense_precision=int8 stores in int8 (routers and the shared-expert gate stay).
INT8_DENSE = ("wqkv", "wo", "mlp_w13", "mlp_w2", "shared_w13", "shared_w2")


def owned(t: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``t`` (``source`` as loaded: device and dtype) in memory of its own where it still shares the
    checkpoint's memory mapping: a CPU tensor the conversion did not copy.

    A mapped file sits in 4 KiB pages of the page cache; PyTorch's own allocations of 2 MiB and more take
    transparent huge pages (engine.env.apply_huge_pages), as the matrices concatenated or stacked at load
    (wqkv, the experts) already did, so every matrix a step reads whole streams through 2 MiB pages. The
    lm head and each wo had been read from the mapping until 2026-12-06 (/proc/PID/smaps: no AnonHugePages
    there). The lm head in a batch-1 decode step of the medium preset, AMX Xeon, medians of 150 steps, ms,
    alternated pairs mapped -> own: the lm head alone copied 1.98 / 1.80 / 1.96 -> 1.73 / 1.59 / 1.86; this
    function 2.17 / 1.98 / 2.10 / 2.08 -> 1.97 / 2.09 / 2.00 / 1.99, or as a share of the same step's fused
    call (which the shared host's drift moves alike) 0.157-0.165 -> 0.151-0.153: about 0.1 ms a token."""
    if t.device.type == "cpu" and t.data_ptr() == source.data_ptr():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, as the reference implementations do."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def kv_dtype(choice: str, compute: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for the ``runtime.kv_dtype`` knob: auto = the compute dtype."""
    return compute if choice == "auto" else {"float32": torch.float32, "bfloat16": torch.bfloat16}[choice]


class KVCache:
    """Per-layer K and V tensors of shape [slots, KV heads, capacity, head_dim]. ``dtype`` may differ from the
    compute dtype (``runtime.kv_dtype``): keys and values are rounded to it when written and widened when read.

    On the CPU the tensors hold ``max_len`` positions from the start, in anonymous private mappings: the
    kernel hands out zeroed pages on first touch, so a cache commits memory only as positions are written,
    and it never moves (a growing cache reallocated and copied every layer of every slot inside one step:
    at 32 slots of the medium model, 0.06-0.2 s from 256 to 512 positions, 1.5-6.8 s from 2048 to 4096,
    measured on a 2-core Xeon, 2026-12-04). Where the mapping is
    refused (a strict overcommit policy, a reservation larger than memory), and on other devices, capacity
    grows on demand instead (and with ``reserve=False``): from ``initial_len`` positions, doubled, the old
    positions copied, the new ones zeroed."""

    def __init__(self, spec: ModelSpec, n_slots: int, max_len: int, dtype: torch.dtype, device: torch.device,
                 initial_len: int = 256, reserve: bool = True):
        self.spec, self.n_slots, self.max_len, self.dtype, self.device = spec, n_slots, max_len, dtype, device
        self.serial = next(_CACHE_SERIALS)  # expert-parallel ranks keep one cache per cache of rank 0
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.reserved = reserve and device.type == "cpu" and self._reserve()
        if not self.reserved:
            self.ensure(min(initial_len, max_len))

    def _shape(self, capacity: int) -> tuple[int, int, int, int]:
        return (self.n_slots, self.spec.n_kv_heads, capacity, self.spec.head_dim)

    def _reserve(self) -> bool:
        """Map every layer's K and V at ``max_len`` positions; False (nothing kept) where a mapping is refused."""
        if not hasattr(mmap, "MAP_PRIVATE"):
            return False
        shape = self._shape(self.max_len)
        nbytes = math.prod(shape) * self.dtype.itemsize
        k, v = [], []
        try:
            for _ in range(self.spec.n_layers):
                for out in (k, v):
                    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                    if hasattr(region, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
                        region.madvise(mmap.MADV_NOHUGEPAGE)  # commit 4 KiB at a time, as positions fill
                    out.append(torch.frombuffer(region, dtype=self.dtype).view(shape))
        except (OSError, OverflowError):  # ENOMEM (overcommit policy, address space, ulimit -v); beyond ssize_t
            return False
        self.k, self.v, self.capacity = k, v, self.max_len
        return True

    def ensure(self, length: int) -> None:
        if length <= self.capacity:
            return
        if length > self.max_len:
            raise ValueError(f"sequence of {length} tokens exceeds max_seq_len_tokens={self.max_len}")
        cap = min(self.max_len, max(length, 2 * self.capacity, 64) if self.capacity else length)
        new_k, new_v = [], []
        for i in range(self.spec.n_layers):
            for old, out in ((self.k, new_k), (self.v, new_v)):
                t = torch.empty(self._shape(cap), dtype=self.dtype, device=self.device)
                if self.capacity:
                    t[:, :, : self.capacity] = old[i]
                t[:, :, self.capacity:] = 0  # the PyTorch decode path reads (masked) past a slot's length
                out.append(t)
        self.k, self.v, self.capacity = new_k, new_v, cap

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class RoPE:
    """Rotary embedding tables (default RoPE), computed in fp32 and cast like the references.

    On the CPU the rows of positions below ``TABLE_POSITIONS`` come from a table built once (per dtype, grown
    by doubling as positions rise): the same elementwise operations give the same bits as computing them per
    step, in two row lookups instead of seven ops, which ran cold after the step had streamed its weights
    through the caches (``cos_sin`` of a medium-preset decode step at batch 1 and 32, 2-core Xeon: 0.13-0.35 ->
    0.07-0.15 ms)."""

    TABLE_POSITIONS = 16384  # at head_dim 128, cos and sin tables of 16 MB in fp32 at most

    def __init__(self, head_dim: int, theta: float, device: torch.device):
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
                                          / head_dim))
        self.device = device
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, d]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, d] of ``positions`` [T] (int64), in ``dtype``."""
        if self.device.type != "cpu" or positions.numel() == 0:  # (a device's max() would wait for it)
            return self._compute(positions, dtype)
        end = int(positions.max()) + 1
        if end > self.TABLE_POSITIONS:
            return self._compute(positions, dtype)
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] < end:
            have = table[0].shape[0] if table is not None else 0
            n = min(self.TABLE_POSITIONS, max(end, 2 * have, 256))
            table = self._tables[dtype] = self._compute(torch.arange(n, device=self.device), dtype)
        return table[0].index_select(0, positions), table[1].index_select(0, positions)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, d]; cos/sin: [T, d]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class MoEDecoder:
    """Weights of a checkpoint on one device, and the forward pass.

    Activations, norms, routers and the KV cache are in the compute dtype ``dtype``; the weight
    matrices (embeddings, projections, experts, lm head) in ``weight_dtype``, which differs only where
    the native CPU kernels compute fp32 products straight from bf16/fp16 weights (:mod:`engine.kernels`).
    """

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device,
                 expert_device: torch.device | None = None, weight_dtype: torch.dtype | None = None,
                 load_experts: bool = True):
        self.spec: ModelSpec = ckpt.spec
        self.dtype = dtype
        self.weight_dtype = weight_dtype or dtype
        self.native = self.weight_dtype != dtype  # products through engine.kernels
        if self.native:
            kernels.prepare()  # the measured path per precision and token count (once per machine)
        # Routers (fp32) run natively below this many tokens, on PyTorch's GEMM from it (measured per machine
        # and router shape where the native kernels run, once: router_torch_from).
        self._router_from: int | None = None
        self.device = device
        # Where the stacked expert weights are loaded: the host when only some experts may be resident.
        self.expert_device = expert_device or device
        self.stats = MoEStats()  # tokens routed per expert, counted once per step and MoE layer
        # The fused decode step: ((cache serial, capacity), DecodeStack, expert precision, the executor's
        # stacked experts it holds); see _decode_stack.
        self._stack: tuple[tuple[object, object], object, str, object] | None = None
        self.hybrid = None  # engine.moe.experts.HybridExperts when the config is not the plain one
        self.version_cache = None  # engine.moe.experts.VersionCache: int8/int4 experts built from these weights
        # engine.parallel.ep.EPExperts under expert parallelism: this rank's experts (then the routed
        # experts are not loaded here, ``load_experts=False``), dispatch and combine.
        self.ep = None
        self.load_experts = load_experts
        self._moe_index = {layer: i for i, layer in enumerate(ckpt.spec.moe_layers)}
        # Plans of the plain engine: every routed expert on its loaded copy (see reset_plans).
        self._plain = ResidencyController(PlanSettings(len(ckpt.spec.moe_layers), ckpt.spec.n_experts))
        self.top_k_override = 0
        self.min_gate_weight = 0.0
        self.record_routes = False
        # Decode-only steps in one native call where they can (_decode_stack); False runs them op by op, as
        # prompt steps run (the same ops, the same bits: for comparisons and tests).
        self.fuse_decode = True
        # runtime.dense_precision: "as_loaded", or "int8" (LayerWeights.int8 and lm_head_int8 run the products)
        self.dense_precision = "as_loaded"
        self.lm_head_int8: tuple[torch.Tensor, torch.Tensor] | None = None
        self.int8_grouped = False  # some int8 dense copy has group scales (DENSE_INT8_GROUP)
        self.routes: list[RouteRecord] = []
        spec = self.spec
        self.rope = RoPE(spec.head_dim, spec.rope_theta, device)
        self.scale = 1.0 / math.sqrt(spec.head_dim)

        def load(names: list[str], matrix_dtype: torch.dtype = self.weight_dtype, own: bool = True) -> list[torch.Tensor]:
            """Matrices in ``matrix_dtype`` (the weight dtype unless told), vectors (norms, biases) in the
            compute dtype; with ``own``, in memory of their own (:func:`owned`), not the checkpoint's mapping."""
            got = dict(ckpt.tensors(names))
            out = [got[n].to(device=device, dtype=matrix_dtype if got[n].dim() == 2 else dtype) for n in names]
            return [owned(t, got[n]) if own else t for t, n in zip(out, names, strict=True)]

        # The embedding's rows are read a token at a time: it stays in the checkpoint's mapping (only the rows
        # read are paged in) unless it is the lm head too, which every step reads whole.
        (self.embed,) = load(["model.embed_tokens.weight"], own=spec.tie_word_embeddings)
        (self.final_norm,) = load(["model.norm.weight"])
        self.lm_head = self.embed if spec.tie_word_embeddings else load(["lm_head.weight"])[0]
        self.layers: list[LayerWeights] = []
        for i in range(spec.n_layers):
            self.layers.append(self._load_layer(ckpt, i, load))

    def _load_layer(self, ckpt: Checkpoint, i: int, load) -> LayerWeights:
        spec = self.spec
        p = f"model.layers.{i}."
        a = p + "self_attn."
        ln1, ln2, wq, wk, wv, wo = load([p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                                         a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight",
                                         a + "o_proj.weight"])
        bqkv = torch.cat(load([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"])) if spec.qkv_bias else None
        q_norm = k_norm = None
        if spec.qk_norm != "none":
            q_norm, k_norm = load([a + "q_norm.weight", a + "k_norm.weight"])
        bo = load([a + "o_proj.bias"])[0] if spec.o_bias else None
        lw = LayerWeights(ln1, ln2, torch.cat([wq, wk, wv]).contiguous(), bqkv, wo, q_norm, k_norm, bo)
        if not spec.is_moe_layer(i):
            g, u, d = load([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"])
            lw.mlp_w13, lw.mlp_w2 = torch.cat([g, u]).contiguous(), d
            return lw
        (lw.router,) = load([ckpt.router_name(i)], self.dtype)  # routing is computed in the compute dtype
        if self.load_experts:
            lw.w13, lw.w2 = self._load_experts(ckpt, i)
        if spec.shared_expert_intermediate:
            s = p + "mlp.shared_expert."
            g, u, d = load([s + "gate_proj.weight", s + "up_proj.weight", s + "down_proj.weight"])
            (sg,) = load([p + "mlp.shared_expert_gate.weight"], self.dtype)
            lw.shared_w13, lw.shared_w2, lw.shared_gate = torch.cat([g, u]).contiguous(), d, sg
        return lw

    def _load_experts(self, ckpt: Checkpoint, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        w13 = torch.empty(spec.n_experts, 2 * spec.expert_intermediate, spec.hidden_size, dtype=self.weight_dtype,
                          device=self.expert_device)
        w2 = torch.empty(spec.n_experts, spec.hidden_size, spec.expert_intermediate, dtype=self.weight_dtype,
                         device=self.expert_device)
        ckpt.read_experts(i, w13, w2)
        return w13, w2

    @property
    def hybrid(self):
        """The hybrid expert executor (engine.moe.experts.HybridExperts), or None for the plain config."""
        return self._hybrid

    @hybrid.setter
    def hybrid(self, executor) -> None:
        self._hybrid = executor
        self._stack = None  # the fused decode step holds the experts it ran on: rebuilt on next use

    @property
    def controller(self) -> ResidencyController:
        """Who plans the experts of every MoE layer: the hybrid executor's controller, or the plain one."""
        return self.hybrid.controller if self.hybrid is not None else self._plain

    def reset_plans(self, log: DecisionLog | None = None, settings: PlanSettings | None = None) -> None:
        """Start the expert plans afresh (the initial placement), writing them to ``log``; ``settings``
        replace the plain engine's (a plain config's, so the decision log says what it asked for)."""
        if self.hybrid is not None:
            self.hybrid.reset(log)
        else:
            self._plain = ResidencyController(settings or self._plain.settings, log=log)

    def end_step(self, n_tokens: int) -> None:
        """After a forward step of ``n_tokens`` tokens: the controller's step-end decisions, executed."""
        ctl = self.controller
        counts = self.stats.step_counts(self.spec.moe_layers) if ctl.wants_step_counts else None
        if self.hybrid is not None:
            self.hybrid.observe(counts, n_tokens)
        else:
            ctl.end_step(counts, n_tokens)
        if self.ep is not None:
            self.ep.stats.end_step()

    def set_dense_precision(self, precision: str) -> None:
        """Run the dense matrices (:data:`INT8_DENSE` and the lm head) ``"as_loaded"`` or in ``"int8"``: int8
        copies with a scale per :data:`DENSE_INT8_GROUP` weights of a row, made on first use and kept, so switching back and forth costs
        nothing. ValueError where the native CPU kernels do not run this model."""
        if precision not in ("as_loaded", "int8"):
            raise ValueError(f"dense precision {precision!r}: expected as_loaded or int8")
        if precision == "int8" and not (self.native and self.device.type == "cpu" and self.ep is None):
            raise ValueError("int8 dense matrices run on the native CPU kernels, which this model does not use "
                             f"here ({self.device.type}, {self.weight_dtype} weights, {self.dtype} compute"
                             + (", expert parallelism" if self.ep is not None else "") + ")")
        if precision == "int8" and self.lm_head_int8 is None:
            from engine.moe import quant

            def q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                if w.shape[1] % DENSE_INT8_GROUP == 0:
                    return quant.quantize_int8_groups(w, DENSE_INT8_GROUP)
                qw = quant.quantize(w, "int8")  # one scale a row
                return qw.data.contiguous(), qw.scales.contiguous()

            for lw in self.layers:
                lw.int8 = {name: q8(getattr(lw, name)) for name in INT8_DENSE if getattr(lw, name) is not None}
            self.lm_head_int8 = q8(self.lm_head)
            # any copy with group scales: the dense products take the q8 mode, which applies them per block
            self.int8_grouped = any(sc.dim() == 2 for lw in self.layers for _, sc in lw.int8.values()) \
                or self.lm_head_int8[1].dim() == 2
        if precision != self.dense_precision:
            self._stack = None  # the fused step holds the matrices it runs: rebuilt on next use
        self.dense_precision = precision

    def _q8(self, lw: LayerWeights, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The int8 copy of ``lw``'s dense matrix ``name`` while the dense matrices run in int8, else None."""
        return lw.int8.get(name) if self.dense_precision == "int8" and lw.int8 else None

    def run_bytes(self, lw: LayerWeights, name: str) -> int:
        """Bytes a step reads of ``lw``'s tensor ``name`` in the precision it runs in (its int8 copy and
        scales while the dense matrices run in int8); 0 where the layer has none."""
        q = self._q8(lw, name) if name in INT8_DENSE else None
        return sum(x.numel() * x.element_size() for x in q or (getattr(lw, name),) if x is not None)

    def head_bytes(self) -> int:
        """Bytes a step reads of the final norm and the lm head, in the precision the head runs in."""
        head = self.lm_head_int8 if self.dense_precision == "int8" else (self.lm_head,)
        return sum(x.numel() * x.element_size() for x in (self.final_norm, *head))

    def dense_bytes(self) -> int:
        """Bytes of the non-expert weights one step reads, in the precision they run in: attention, norms,
        routers, dense and shared MLPs, the final norm and the lm head (not the embedding rows)."""
        total = sum(self.run_bytes(lw, k) for lw in self.layers for k, t in vars(lw).items()
                    if isinstance(t, torch.Tensor) and k not in ("w13", "w2"))
        return total + self.head_bytes()

    def weight_bytes(self) -> int:
        ts = [self.embed, self.final_norm] + ([] if self.spec.tie_word_embeddings else [self.lm_head])
        ts += list(self.lm_head_int8 or ())
        for lw in self.layers:
            ts += [t for t in vars(lw).values() if isinstance(t, torch.Tensor)]
            ts += [x for pair in (lw.int8 or {}).values() for x in pair]
        local = self.ep.weight_bytes() if self.ep is not None else 0  # this rank's experts
        return sum(t.numel() * t.element_size() for t in ts) + local

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, batch: StepBatch, cache: KVCache) -> torch.Tensor:
        """Run one step; returns fp32 logits [S', V] for the segments with ``wants_logits``, in order."""
        spec = self.spec
        if self.ep is not None:
            self.ep.before_forward(batch, cache)  # rank 0: every other rank runs this step too
        x = self.embed.index_select(0, batch.token_ids).to(self.dtype)  # [T, H]
        cos, sin = self.rope.cos_sin(batch.positions, self.dtype)  # [T, d]
        plan = _AttentionPlan(batch, cache, cache.device)
        if self.record_routes:
            self.routes = []
        stack = self._decode_stack(plan, cache)
        if stack is not None:
            self._fused_decode(stack, x, cos, sin, plan)
        else:
            h = self._norm(x, self.layers[0].ln1)
            for i, lw in enumerate(self.layers):
                h = self._add_norm(x, self._attention(i, lw, h, cos, sin, plan, cache), lw.ln2)
                y = self._moe(i, lw, h) if lw.router is not None else self._mlp(lw, "mlp", h)
                if i + 1 < len(self.layers):
                    h = self._add_norm(x, y, self.layers[i + 1].ln1)
                else:
                    x.add_(y)
        if batch.all_logits:
            rows = list(range(batch.n_tokens))
        else:
            rows = [s.start + s.n_tokens - 1 for s in batch.segments if s.wants_logits]
        if not rows:
            return torch.empty(0, spec.vocab_size)
        # A decode step wants every row in order: x itself (the norm below writes a new tensor).
        xr = x if rows == list(range(batch.n_tokens)) else x.index_select(0, torch.tensor(rows, device=self.device))
        xr = self._norm(xr, self.final_norm)
        head_q = self.lm_head_int8 if self.dense_precision == "int8" else None
        return self._linear(xr, self.lm_head, None, head_q).float()  # [S', V]

    # ------------------------------------------------------------------ the fused decode step
    def _stacked_experts(self) -> list[tuple[str, torch.Tensor, torch.Tensor | None, torch.Tensor,
                                             torch.Tensor | None, int]] | None:
        """Per MoE layer, the experts a fused decode step runs on: (precision, w13, s13, w2, s2, group). The
        loaded stacked weights for the plain config; the hybrid executor's stacked copies where its plans are
        trivial (every expert resident in one integer precision); None where the plans need the executor."""
        if self.hybrid is None:
            if any(lw.router is not None and lw.w13 is None for lw in self.layers):
                return None
            prec = precision_of(self.weight_dtype)
            return [(prec, lw.w13, None, lw.w2, None, 0) for lw in self.layers if lw.router is not None]
        stacked = self.hybrid.stacked
        if stacked is None:
            return None
        return [(st.precision, st.w13, st.s13, st.w2, st.s2, st.group_size or 0) for st in stacked]

    def _decode_stack(self, plan: _AttentionPlan, cache: KVCache):
        """The fused decode step (``moetune::DecodeStack``) for this step, or None where the per-op path must
        run it: a step with prompt tokens, decode attention on another device, expert parallelism, routing
        overrides (pruned in Python), plans that need the hybrid executor, or too many tokens per expert for
        the native MoE (PyTorch's GEMM, expert by expert). Built once per set of weights and experts; the
        KV cache is handed over again whenever it was reallocated."""
        if not (self.fuse_decode and self.native and plan.all_decode and cache.device == self.device and self.device.type == "cpu"
                and self.ep is None and self.top_k_override == 0 and self.min_gate_weight <= 0
                and self.controller.settings.trivial):
            return None
        spec = self.spec
        if self._stack is not None and self.hybrid is not None and self._stack[3] is not self.hybrid.stacked:
            self._stack = None  # the executor's stacked copies changed (or were dropped) since the build
        if self._stack is None:
            experts = self._stacked_experts()
            if experts is None:
                return None
            stack = torch.classes.moetune.DecodeStack(spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.rms_eps,
                                                      spec.qk_norm, float(spec.clip_qkv or 0.0),
                                                      spec.sliding_window or 0, self.scale, spec.top_k,
                                                      spec.norm_topk_prob)
            moe = iter(experts)
            for lw in self.layers:
                stack.add_attention(lw.ln1, lw.ln2, lw.wqkv, lw.bqkv, lw.wo, lw.bo, lw.q_norm, lw.k_norm)
                if lw.router is not None:
                    _, w13, s13, w2, s2, group = next(moe)
                    stack.set_moe(lw.router, w13, s13, w2, s2, group, lw.shared_w13, lw.shared_w2, lw.shared_gate)
                else:
                    stack.set_mlp(lw.mlp_w13, lw.mlp_w2)
                for name, (q, sc) in (lw.int8 or {}).items() if self.dense_precision == "int8" else ():
                    stack.set_int8(name, q, sc)
            stack.set_router_torch_from(self.router_torch_from())
            prec = experts[0][0] if experts else precision_of(self.weight_dtype)
            self._stack = ((None, None), stack, prec, self.hybrid.stacked if self.hybrid is not None else None)
        (serial, capacity), stack, prec, held = self._stack
        t = int(plan.lens.shape[0])
        if spec.n_experts and not kernels.fused_moe(prec, t * spec.top_k / spec.n_experts):
            return None
        if (serial, capacity) != (cache.serial, cache.capacity):
            stack.set_cache(cache.k, cache.v)
            self._stack = ((cache.serial, cache.capacity), stack, prec, held)
        return stack

    def _dense_path(self, tokens: int) -> str:
        """The native path of the dense products at ``tokens`` tokens, in the precision they run in (int8
        dense matrices always take a native path: the fused step and :func:`kernels.linear_int8` read them)."""
        if self.dense_precision == "int8":
            return kernels.int8_path(tokens, grouped=self.int8_grouped)
        return kernels.path(precision_of(self.weight_dtype), tokens)

    def _fused_decode(self, stack, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      plan: _AttentionPlan) -> None:
        """Every layer of a decode-only step in one native call (``x`` updated in place); then what the
        per-op path records layer by layer, for the whole step: the plans, the routed counts and the routes."""
        spec = self.spec
        t = x.shape[0]
        prec = self._stack[2]  # type: ignore[index]
        moe_path = kernels.moe_path(prec, t * spec.top_k / max(spec.n_experts, 1), spec.hidden_size,
                                    spec.expert_intermediate)
        ids, gates, counted = stack.step(x, cos, sin, plan.slot_index, plan.lens,
                                         self._dense_path(t), moe_path)  # [L, T, K], [L, E]
        self.stats.fused_steps += 1
        if ids.shape[0] == 0:
            return
        # The counts come from the step, and add_step splits them by layer only when read: numpy's counting and
        # splitting ran cold after the weights had streamed through the caches (this bookkeeping, timed after
        # 400 MB read: 0.38-0.43 -> 0.14-0.28 ms a step, medians of 30 in 5 alternated rounds, AMX Xeon).
        ctl = self.controller
        ids_tlk = ids.numpy().transpose(1, 0, 2) if ctl.reads_ids(t) else None
        _, counts = ctl.plan_step(ids_tlk, counted.numpy(), n_tokens=t)
        self.stats.add_step(spec.moe_layers, counts)
        if self.record_routes:
            self.routes.extend(RouteRecord(layer, ids[i], gates[i]) for i, layer in enumerate(spec.moe_layers))

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.native:
            return kernels.ops().rmsnorm(x, w, self.spec.rms_eps)
        return rms_norm(x, w, self.spec.rms_eps)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The residual update ``x += delta`` in place, then the next RMSNorm of ``x``."""
        if self.native:
            return kernels.ops().add_rmsnorm_(x, delta, w, self.spec.rms_eps)
        x.add_(delta)
        return rms_norm(x, w, self.spec.rms_eps)

    def _qkv(self, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections, q/k norms, clipping and rotary embedding: q [T, Hq, d], k and v [T, KV, d]."""
        spec = self.spec
        t = h.shape[0]
        qkv = self._linear(h, lw.wqkv, lw.bqkv, self._q8(lw, "wqkv"))  # [T, Q + 2KV]
        if self.native:
            return kernels.ops().qk_rope(qkv, spec.n_heads, spec.n_kv_heads, spec.head_dim, lw.q_norm, lw.k_norm,
                                         spec.qk_norm, spec.rms_eps, spec.clip_qkv or 0.0, cos, sin)
        q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        if spec.qk_norm == "full":
            q = rms_norm(q, lw.q_norm, spec.rms_eps)
            k = rms_norm(k, lw.k_norm, spec.rms_eps)
        if spec.clip_qkv is not None:
            q, k, v = (z.clamp(-spec.clip_qkv, spec.clip_qkv) for z in (q, k, v))
        q = q.reshape(t, spec.n_heads, spec.head_dim)
        k = k.reshape(t, spec.n_kv_heads, spec.head_dim)
        v = v.reshape(t, spec.n_kv_heads, spec.head_dim)
        if spec.qk_norm == "head":
            q = rms_norm(q, lw.q_norm, spec.rms_eps)
            k = rms_norm(k, lw.k_norm, spec.rms_eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _attention(self, i: int, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   plan: _AttentionPlan, cache: KVCache) -> torch.Tensor:
        spec = self.spec
        t = h.shape[0]
        q, k, v = self._qkv(lw, h, cos, sin)
        kc, vc = cache.k[i], cache.v[i]
        on_host = cache.device != self.device  # decode attention placed on the host: its KV cache lives there
        if on_host:
            q, k, v = q.to(cache.device), k.to(cache.device), v.to(cache.device)
        if self.native and not on_host and plan.all_decode:
            # A decode-only step: one call writes the step's keys and values and attends, the cache read in place.
            out = kernels.ops().decode_attention(q, kc, vc, plan.slot_index, plan.lens, spec.sliding_window or 0,
                                                 self.scale, k.contiguous(), v.contiguous())
            return self._linear(out.reshape(t, spec.q_size), lw.wo, lw.bo, self._q8(lw, "wo"))
        if self.native and not on_host and q.dtype == torch.float32 and kc.dtype in (torch.float32, torch.bfloat16):
            return self._linear(self._native_attention(q, k, v, kc, vc, plan).reshape(t, spec.q_size), lw.wo, lw.bo,
                                self._q8(lw, "wo"))
        # Write the step's keys and values into the cache: [slot, head, pos, d] (in the cache's dtype).
        kc[plan.slot_of_token, :, plan.pos_of_token] = k.to(kc.dtype)
        vc[plan.slot_of_token, :, plan.pos_of_token] = v.to(vc.dtype)
        out = torch.empty(t, spec.n_heads, spec.head_dim, dtype=self.dtype, device=cache.device)
        if plan.decode_rows is not None:
            qd = q.index_select(0, plan.decode_rows)[:, :, None, :]  # [B, Hq, 1, d]
            kd = plan.gather(kc).to(q.dtype)  # [B, KV, L, d]
            vd = plan.gather(vc).to(q.dtype)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.decode_mask, scale=self.scale,
                                                enable_gqa=spec.n_kv_heads != spec.n_heads)
            out.index_copy_(0, plan.decode_rows, od[:, :, 0, :])
        for seg in plan.prefill:
            end = seg.past_len + seg.n_tokens
            qs = q[seg.start: seg.start + seg.n_tokens].transpose(0, 1)[None]  # [1, Hq, n, d]
            ks = kc[seg.slot: seg.slot + 1, :, :end].to(q.dtype)  # [1, KV, past+n, d]
            vs = vc[seg.slot: seg.slot + 1, :, :end].to(q.dtype)
            if on_host:  # prompt chunks are compute-heavy: they attend on the device
                qs, ks, vs = qs.to(self.device), ks.to(self.device), vs.to(self.device)
            mask = plan.prefill_mask(seg, spec.sliding_window)
            if mask is not None:
                mask = mask.to(qs.device)
            os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None,
                                                 scale=self.scale, enable_gqa=spec.n_kv_heads != spec.n_heads)
            out[seg.start: seg.start + seg.n_tokens] = os_[0].transpose(0, 1).to(out.device)
        if on_host:
            out = out.to(self.device)
        return self._linear(out.reshape(t, spec.q_size), lw.wo, lw.bo, self._q8(lw, "wo"))

    def _native_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                          plan: _AttentionPlan) -> torch.Tensor:
        """A step with prompt tokens on the native kernels: each prompt segment's tokens in one call
        (``prefill_attention``: causal over the cache up to each token, its keys and values written first),
        the decode rows together (``decode_attention``). Against PyTorch's flash kernel on the AMX Xeon (a
        128-token prompt of the medium preset, 2 threads, a layer, with the writes and copies it saves): 417 -> 192 us."""
        spec = self.spec
        window, ops = spec.sliding_window or 0, kernels.ops()
        segs = plan.prefill
        if len(segs) == 1 and plan.decode_rows is None:  # one prompt: no copies
            s = segs[0]
            return ops.prefill_attention(q, kc, vc, s.slot, s.past_len, window, self.scale, k, v)
        out = torch.empty_like(q)
        if plan.decode_rows is not None:
            rows = plan.decode_rows
            out[rows] = ops.decode_attention(q[rows], kc, vc, plan.slot_index, plan.lens, window, self.scale,
                                             k[rows], v[rows])
        for s in segs:
            part = slice(s.start, s.start + s.n_tokens)
            out[part] = ops.prefill_attention(q[part], kc, vc, s.slot, s.past_len, window, self.scale, k[part],
                                              v[part])
        return out

    def _linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                q8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x @ w.T + bias``; on ``q8`` (int8 weights, row scales: runtime.dense_precision=int8) when given."""
        if q8 is not None:
            return kernels.linear_int8(x, q8[0], q8[1], bias)
        return kernels.linear(x, w, bias) if self.native else F.linear(x, w, bias)

    def _mlp(self, lw: LayerWeights, kind: str, h: torch.Tensor) -> torch.Tensor:
        """The SwiGLU MLP ``kind`` of ``lw``: "mlp" (a dense layer) or "shared" (the shared expert)."""
        gu = self._linear(h, getattr(lw, f"{kind}_w13"), None, self._q8(lw, f"{kind}_w13"))  # [T, 2D]
        d = gu.shape[-1] // 2
        return self._linear(F.silu(gu[:, :d]) * gu[:, d:], getattr(lw, f"{kind}_w2"), None, self._q8(lw, f"{kind}_w2"))

    def route(self, lw: LayerWeights, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routes the experts run: ([T, K] weights, [T, K] ids), after the routing knobs.

        With a routing override (top-k override, minimum gate weight) skipped slots get weight 0 and
        id -1, as :func:`engine.moe.policy.prune_routes` (the one implementation) decides.
        """
        return self._prune(*self._route_model(lw, h))

    def router_torch_from(self) -> int:
        """From how many tokens the routers' products run on PyTorch's GEMM rather than the native kernels
        (:func:`engine.calibrate.router_torch_tokens`, measured once per machine and router shape; 1 without
        the native kernels or routers)."""
        if self._router_from is None:
            from engine.calibrate import router_torch_tokens

            spec = self.spec
            self._router_from = (router_torch_tokens(spec.n_experts, spec.hidden_size)
                                 if self.native and spec.n_experts else 1)
        return self._router_from

    def routes_natively(self, tokens: int) -> bool:
        """Whether a step of ``tokens`` tokens runs its routers' products on the native kernels."""
        return tokens < self.router_torch_from()

    def _route_model(self, lw: LayerWeights, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own routing: softmax over experts in fp32, top-k (the larger of the model's k and
        the override), optional renormalisation: ([T, K'] weights, [T, K'] ids), weights descending."""
        k = self.spec.top_k
        if self.routes_natively(h.shape[0]):
            logits = kernels.ops().linear(h, lw.router, None)  # [T, E]
            if self.top_k_override <= k:
                return kernels.ops().route(logits, k, self.spec.norm_topk_prob)
        else:
            logits = F.linear(h, lw.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        k_run = max(k, self.top_k_override)  # an override above the model's k routes to more experts
        weights, ids = torch.topk(probs, k_run, dim=-1)  # [T, K], descending
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def _prune(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_run = ids.shape[1]
        cut = self.top_k_override if 0 < self.top_k_override < k_run else None
        if cut is None and self.min_gate_weight <= 0:
            return weights, ids
        w, i, _ = prune_routes(weights.float().cpu().numpy(), ids.cpu().numpy(), cut, self.min_gate_weight)
        return torch.from_numpy(w).to(weights.device), torch.from_numpy(i).to(ids.device)

    def _model_route(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's top-k of routes computed with a larger k (what a router trace holds)."""
        k = self.spec.top_k
        if ids.shape[1] == k:
            return weights, ids
        w = weights[:, :k]
        return (w / w.sum(dim=-1, keepdim=True) if self.spec.norm_topk_prob else w), ids[:, :k]

    def _moe(self, i: int, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        """One MoE layer: route, plan (the controller), count, then run the experts as planned; the
        paths below differ only in the kernel they call."""
        raw_w, raw_ids = self._route_model(lw, h)
        if self.record_routes:
            model_w, model_ids = self._model_route(raw_w, raw_ids)
            self.routes.append(RouteRecord(i, model_ids, model_w))
        weights, ids = self._prune(raw_w, raw_ids)
        ids_host = ids.cpu().numpy()
        decision = self.controller.plan_layer(self._moe_index[i], ids_host)
        self.stats.add(i, decision.counts)
        if self.hybrid is not None:
            out = self.hybrid.forward(i, h, weights, ids, decision)
        elif self.ep is not None:  # this rank's experts on the pairs placed here, then the ranks' sum
            out = self.ep.forward(self._moe_index[i], h, weights, ids_host, self.run_experts)
        else:
            out = self.run_experts(lw.w13, lw.w2, h, weights, ids, decision.counts)
        if lw.shared_w13 is not None:
            shared = self._mlp(lw, "shared", h)
            out = out + torch.sigmoid(F.linear(h, lw.shared_gate)) * shared
        return out

    def run_experts(self, w13: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, counts: np.ndarray) -> torch.Tensor:
        """Stacked experts ``w13`` [E', 2I, H] / ``w2`` [E', H, I] on the routes ``ids`` [T, K] (indices into
        them; -1 skips a slot) with ``counts[e]`` pairs each: the gate-weighted sum per token [T, H]."""
        t, k = ids.shape
        pairs = int(counts.sum())
        if self.native and kernels.fused_moe(self.weight_dtype, pairs / max(w13.shape[0], 1)):
            # One call for every expert, all threads, unless this many tokens per expert run faster on
            # PyTorch's GEMM (the crossover measured on this machine): then expert by expert below.
            return kernels.moe(h, w13, w2, ids, weights)
        if t == 1 and pairs == k and self.device.type == "cpu":
            return self._moe_one_token(w13, w2, h, weights, ids)
        return self._moe_grouped(w13, w2, h, weights, ids, counts)

    def _moe_one_token(self, w13: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor) -> torch.Tensor:
        """One token (batch-1 decode): its k experts in turn, no grouping machinery (a third fewer ops)."""
        inter = self.spec.expert_intermediate
        out = None
        for e, g in zip(ids[0].tolist(), weights[0].tolist(), strict=True):
            gu = F.linear(h, w13[e])  # [1, 2I]
            y = F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], w2[e])  # [1, H]
            out = y.mul_(g) if out is None else out.add_(y, alpha=g)
        return out

    def _moe_grouped(self, w13: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor, counts: np.ndarray) -> torch.Tensor:
        """Every expert with tokens runs them as one product (coalesced); tokens grouped by expert."""
        g = Grouped(h, ids, counts)
        ys = torch.empty_like(g.xs)
        inter = self.spec.expert_intermediate
        for e, seg in g.segment.items():
            gu = self._linear(g.xs[seg], w13[e])  # [n, 2I]
            act = F.silu(gu[:, :inter]) * gu[:, inter:]  # [n, I]
            if self.native:
                ys[seg] = kernels.linear(act, w2[e])
            else:
                torch.mm(act, w2[e].t(), out=ys[seg])  # [n, H]
        return g.combine(ys, weights)


class _AttentionPlan:
    """Index tensors for one step's attention, built once and shared by every layer."""

    def __init__(self, batch: StepBatch, cache: KVCache, device: torch.device):
        self.segments = batch.segments
        cache.ensure(max(s.past_len + s.n_tokens for s in batch.segments))
        decode = [s for s in batch.segments if s.n_tokens == 1 and s.past_len > 0]
        self.prefill = [s for s in batch.segments if not (s.n_tokens == 1 and s.past_len > 0)]
        self.window = cache.spec.sliding_window
        starts = [s.start for s in decode]
        # A decode-only step whose rows are its decode tokens in order (as the runtime lays them out).
        self.all_decode = not self.prefill and starts == list(range(len(decode)))
        self.decode_starts: list[int] | None = starts or None
        if decode:
            lens = [s.past_len + 1 for s in decode]
            self.lens = torch.tensor(lens, device=device)
            self.max_len = max(lens)
            slot_ids = [s.slot for s in decode]
            lo = min(slot_ids)
            # Contiguous ascending slots can be a view of the cache; otherwise gather (a copy).
            self.slot_range = (lo, lo + len(slot_ids)) if slot_ids == list(range(lo, lo + len(slot_ids))) else None
            self.slot_index = torch.tensor(slot_ids, device=device)
        self.device = device

    # What the per-op path reads, built where it runs (a fused decode step reads slot_index and lens alone).
    @functools.cached_property
    def slot_of_token(self) -> torch.Tensor:
        return torch.tensor([s.slot for s in self.segments for _ in range(s.n_tokens)], device=self.device)

    @functools.cached_property
    def pos_of_token(self) -> torch.Tensor:
        return torch.tensor([p for s in self.segments for p in range(s.past_len, s.past_len + s.n_tokens)],
                            device=self.device)

    @functools.cached_property
    def decode_rows(self) -> torch.Tensor | None:
        """The rows of the step's decode tokens, None where it has none."""
        return None if self.decode_starts is None else torch.tensor(self.decode_starts, device=self.device)

    @functools.cached_property
    def decode_mask(self) -> torch.Tensor:
        """[B, 1, 1, L]: which cached positions each decode row attends to (PyTorch's decode attention; the
        native kernels read the lengths, so a fused step never builds it: its plan took 0.14 -> 0.09 ms at batch
        32 without it)."""
        ar = torch.arange(self.max_len, device=self.device)
        mask = ar[None, :] < self.lens[:, None]  # [B, L]
        if self.window is not None:
            mask &= ar[None, :] >= (self.lens[:, None] - self.window)
        return mask[:, None, None, :]

    def gather(self, c: torch.Tensor) -> torch.Tensor:
        if self.slot_range is not None:
            return c[self.slot_range[0]: self.slot_range[1], :, : self.max_len]
        return c[:, :, : self.max_len].index_select(0, self.slot_index)

    def prefill_mask(self, seg: Segment, window: int | None) -> torch.Tensor | None:
        if seg.past_len == 0 and window is None:
            return None  # plain causal
        end = seg.past_len + seg.n_tokens
        qpos = torch.arange(seg.past_len, end, device=self.device)[:, None]
        kpos = torch.arange(end, device=self.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        return mask[None, None]  # [1, 1, n, past+n]
