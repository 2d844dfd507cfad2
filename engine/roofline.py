"""Rooflines from what a step really reads and computes, against this machine's measured limits.

Bytes per step count the weights in the precisions the engine runs them in (dense matrices in the
weight dtype or int8 with runtime.dense_precision, norms and routers in the compute dtype, each expert the step touches in the precision
it runs in, with its scales) and the KV cache that decode attention reads (in the KV cache's dtype).
FLOP per step count the products (2 per multiply-add) and attention. The bandwidth roofline divides
the bytes by the measured read bandwidth (:func:`engine.calibrate.memory_bandwidth_gbps`: the faster of
PyTorch's sum and the kernels' several-streams read, so that a product cannot beat it); the compute roofline divides each part's FLOP by the peak
the machine measured for the product path that part takes (:func:`engine.kernels.dispatch_report`);
the binding limit is the slower of the two, and "fraction of roofline" is of that one.

On an accelerator (:class:`Limits` from :func:`machine_limits`) the bytes are split by where they are
read: the experts a step computes on the host read host memory, the rest (dense weights, resident and
fetched experts, the KV cache) the accelerator's memory, and fetched experts also cross the host link;
the three proceed at once, so the bandwidth roofline is the slowest of them. Products on the
accelerator are priced at its measured peak in the compute precision (int8/int4 weights are multiplied
in it), the host's experts at the host path's peak.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Limits:
    """The measured limits a step's roofline divides by.

    ``read_gbps``: the memory the step's device reads (host DRAM on the CPU, the GPU's own memory on
    CUDA); ``host_read_gbps``: host DRAM, which experts computed on the host read; ``link_gbps``: host
    to device copies (fetched experts; None on the CPU); ``device_peak_gflops``: the accelerator's
    matrix-product peak by precision (None on the CPU, whose paths' peaks are in the kernels' report).
    """

    device: str
    read_gbps: float
    host_read_gbps: float
    link_gbps: float | None = None
    device_peak_gflops: dict[str, float] | None = None

    @classmethod
    def host(cls, read_gbps: float) -> Limits:
        return cls("cpu", float(read_gbps), float(read_gbps))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def machine_limits(device: torch.device | str, fresh: bool = False) -> Limits:
    """This machine's limits for a step on ``device``: measured (and cached) by :mod:`engine.calibrate`;
    ``fresh`` measures the host bandwidth again (it drifts on a shared machine)."""
    from engine.calibrate import device_limits, memory_bandwidth_gbps

    device = torch.device(device)
    host = memory_bandwidth_gbps(fresh=fresh)
    if device.type == "cpu":
        return Limits.host(host)
    d = device_limits(device)
    return Limits(device.type, d["read_gbps"], host, d["link_gbps"], d["peak_gflops"])


@dataclass(frozen=True)
class StepCost:
    """What one forward step of ``tokens`` tokens reads and computes."""

    tokens: int
    weight_bytes: float
    kv_bytes: float
    flop_dense: float  # attention projections, routers, dense and shared MLPs, lm head
    flop_experts: float
    flop_attention: float
    dense_path: str  # "precision/path" of the dense products
    expert_path: str
    # Of the above, what experts computed on the host read and compute (an accelerator's step with
    # experts missing from it), and the bytes fetched to the accelerator over the host link.
    host_weight_bytes: float = 0.0
    host_flop: float = 0.0
    link_bytes: float = 0.0
    compute_precision: str = "fp32"  # the activations' precision: what int8/int4 weights are multiplied in

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def flop(self) -> float:
        return self.flop_dense + self.flop_experts + self.flop_attention


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def model_bytes(engine) -> dict[str, float]:
    """Dense bytes every step reads (attention, norms, routers, dense/shared MLPs, lm head), bytes of one
    expert in the precision it runs in (mean over the experts), and KV bytes per cached token."""
    m = engine.model
    dense = m.dense_bytes()  # in the precision the dense matrices run in (runtime.dense_precision)
    hybrid = m.hybrid
    if hybrid is not None:
        versions = [h.fast or h.host for hs in hybrid.handles.values() for h in hs]
        expert = sum(v.nbytes for v in versions) / max(1, len(versions))
        precision = hybrid.hi
    else:
        moe = [lw for lw in m.layers if lw.w13 is not None]
        expert = sum(_nbytes(lw.w13) + _nbytes(lw.w2) for lw in moe) / max(1, len(moe) * engine.spec.n_experts)
        precision = _PRECISION.get(m.weight_dtype, "fp32")
    kv = engine.spec.kv_bytes_per_token(engine.cache.dtype.itemsize)
    return {"dense_bytes": float(dense), "expert_bytes": float(expert), "expert_precision": precision,
            "kv_bytes_per_token": float(kv)}


def phase_bytes(engine, experts_a_step: float, cached_a_step: float) -> dict[str, float]:
    """What a decode step reads in each phase of the fused step (the names of DecodeStack.phase_seconds),
    counted as :func:`step_cost` counts them: ``experts_a_step`` distinct experts a step over all MoE layers,
    ``cached_a_step`` cached positions its attention reads over all its sequences; "outside" is the final
    norm and the lm head. The values add up to the step's bytes (scripts/decode_profile.py --phases sets
    each phase's time beside them)."""
    m = engine.model
    out: dict[str, float] = dict.fromkeys(("norms", "qkv", "rope", "attention", "wo", "router", "experts",
                                           "shared", "mlp", "outside"), 0.0)

    def dense(lw, *names: str) -> int:
        return sum(m.run_bytes(lw, name) for name in names)

    for lw in m.layers:
        out["norms"] += dense(lw, "ln1", "ln2")
        out["qkv"] += dense(lw, "wqkv", "bqkv")
        out["rope"] += dense(lw, "q_norm", "k_norm")
        out["wo"] += dense(lw, "wo", "bo")
        out["router"] += dense(lw, "router")
        out["shared"] += dense(lw, "shared_w13", "shared_w2", "shared_gate")
        out["mlp"] += dense(lw, "mlp_w13", "mlp_w2")
    mb = model_bytes(engine)
    out["experts"] = experts_a_step * mb["expert_bytes"]
    out["attention"] = cached_a_step * mb["kv_bytes_per_token"]
    out["outside"] = float(m.head_bytes())
    return out


def _path(engine, precision: str, tokens: float) -> str:
    """"precision/path" of a product: the native path table where the engine uses the kernels, else
    PyTorch's product in the compute dtype."""
    from engine import kernels

    if engine.model.native and precision in kernels.PRECISIONS:
        return f"{precision}/{kernels.path(precision, max(1, round(tokens)))}"
    compute = _PRECISION.get(engine.dtype, "fp32")
    if precision in ("int8", "int4"):
        return f"{precision}/torch:quant"
    return "bf16/torch:bf16" if compute == "bf16" else "fp32/torch:fp32"


def tier_shares(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, float] | None:
    """What share of a span's expert calls ran on the host, and the bytes fetched per call, from the
    hybrid executor's tier counters (``TierStats.as_dict()``) at its start and end; None without a hybrid
    executor or without calls."""
    if after is None:
        return None
    before = before or {}
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    calls = sum(d.get(k, 0) for k in ("expert_calls_fast_hi", "expert_calls_fast_lo", "expert_calls_host",
                                       "expert_calls_fetched"))
    if calls <= 0:
        return None
    return {"host_call_share": d.get("expert_calls_host", 0) / calls,
            "fetched_bytes_per_call": d.get("bytes_to_fast", 0) / calls}


def step_cost(engine, tokens: int, experts_touched: float, context_tokens: float, decode: bool = True,
              tiers: dict[str, float] | None = None) -> StepCost:
    """A step of ``tokens`` tokens touching ``experts_touched`` distinct experts per MoE layer.

    Decode: each token attends over ``context_tokens`` cached positions (its sequence's length), so the
    step reads ``tokens * context_tokens`` positions of KV cache. Prefill (``decode=False``): one
    sequence's chunk of ``tokens`` tokens after ``context_tokens`` cached ones (causal attention).
    ``tiers`` (:func:`tier_shares`): the share of expert calls computed on the host and the bytes
    fetched per call, as measured; without it every expert is read where the step runs.
    """
    from engine import kernels

    spec = engine.spec
    mb = model_bytes(engine)
    n_moe = len(spec.moe_layers)
    weight_bytes = mb["dense_bytes"] + n_moe * experts_touched * mb["expert_bytes"]
    dense_params = sum(spec.layer_dense_params(i) for i in range(spec.n_layers)) + spec.vocab_size * spec.hidden_size
    flop_dense = 2.0 * dense_params * tokens
    flop_experts = 2.0 * spec.expert_params() * spec.top_k * tokens * n_moe
    if decode:
        positions = tokens * context_tokens  # query-key pairs per layer
        kv_read = positions
    else:
        positions = tokens * context_tokens + tokens * (tokens + 1) / 2
        kv_read = context_tokens + tokens
    flop_attention = 4.0 * spec.q_size * positions * spec.n_layers
    kv_bytes = mb["kv_bytes_per_token"] * kv_read
    if engine.model.dense_precision == "int8":  # the path the decoder runs its int8 copies on (q8 where grouped)
        from engine import kernels

        dense_path = f"int8/{kernels.int8_path(max(1, tokens), engine.model.int8_grouped)}"
    else:
        dense_path = _path(engine, _PRECISION.get(engine.model.weight_dtype, "fp32"), tokens)
    per_expert = tokens * spec.top_k / max(1e-9, experts_touched)
    expert_path = _path(engine, mb["expert_precision"], per_expert)
    prec = mb["expert_precision"]
    if engine.model.native and spec.n_experts and prec in kernels.PRECISIONS and kernels.fused_moe(prec, per_expert):
        expert_path = f"{prec}/{kernels.moe_path(prec, per_expert, spec.hidden_size, spec.expert_intermediate)}"
    calls = n_moe * experts_touched
    host_calls = calls * tiers["host_call_share"] if tiers else 0.0
    link_bytes = calls * tiers["fetched_bytes_per_call"] if tiers else 0.0
    host_flop = flop_experts * host_calls / calls if calls else 0.0
    return StepCost(tokens, weight_bytes, kv_bytes, flop_dense, flop_experts, flop_attention,
                    dense_path, expert_path, host_weight_bytes=host_calls * mb["expert_bytes"],
                    host_flop=host_flop, link_bytes=link_bytes,
                    compute_precision=_PRECISION.get(engine.dtype, "fp32"))


def peak_gflops(path: str) -> float | None:
    """The machine's measured peak GFLOP/s of a "precision/path" (None where it was not measured)."""
    from engine import kernels

    rep = kernels.dispatch_report()
    prec, p = path.split("/", 1)
    p = p.split("/")[0]  # a MoE's "variant:tile/N" (kernels.moe_path): the tiles' peak, the higher
    peaks = rep.get("peak_gflops", {}) if rep.get("available") else {}
    return peaks.get(prec, {}).get(p)  # type: ignore[union-attr]


def roofline(cost: StepCost, limits: Limits | float) -> dict[str, Any]:
    """Both rooflines of a step and which one binds: seconds, tokens/s and the limits used. ``limits``: a
    :class:`Limits`, or the host's read bandwidth in GB/s for a step on the CPU."""
    if not isinstance(limits, Limits):
        limits = Limits.host(limits)
    if limits.device == "cpu":  # one memory serves every read
        parts = {"memory": cost.bytes / (limits.read_gbps * 1e9)}
    else:
        parts = {"device memory": (cost.bytes - cost.host_weight_bytes) / (limits.read_gbps * 1e9),
                 "host memory": cost.host_weight_bytes / (limits.host_read_gbps * 1e9)}
        if cost.link_bytes:
            parts["link"] = cost.link_bytes / ((limits.link_gbps or float("inf")) * 1e9)
    bw_s = max(parts.values())
    host_peak = peak_gflops(cost.expert_path)  # the host's measured path (None without the kernels)
    if limits.device == "cpu":
        dense_peak, expert_peak = peak_gflops(cost.dense_path), host_peak
        compute_s = None
        if dense_peak and expert_peak:
            # Attention runs fp32 dot products: priced at the dense path's peak.
            compute_s = ((cost.flop_dense + cost.flop_attention) / (dense_peak * 1e9)
                         + cost.flop_experts / (expert_peak * 1e9))
    else:
        peaks = limits.device_peak_gflops or {}
        dense_peak = expert_peak = peaks.get(cost.compute_precision)
        compute_s = None
        if dense_peak:
            device_s = (cost.flop - cost.host_flop) / (dense_peak * 1e9)
            host_s = cost.host_flop / (host_peak * 1e9) if cost.host_flop and host_peak else 0.0
            compute_s = max(device_s, host_s)
    bound_s = max(bw_s, compute_s or 0.0)
    return {
        "bytes_per_step": cost.bytes, "weight_bytes_per_step": cost.weight_bytes, "kv_bytes_per_step": cost.kv_bytes,
        "host_weight_bytes_per_step": cost.host_weight_bytes, "link_bytes_per_step": cost.link_bytes,
        "flop_per_step": cost.flop, "dense_path": cost.dense_path, "expert_path": cost.expert_path,
        "dense_peak_gflops": dense_peak, "expert_peak_gflops": expert_peak,
        "bandwidth_roofline_tokens_per_s": cost.tokens / bw_s,
        "bandwidth_bound_by": max(parts, key=parts.get),
        "compute_roofline_tokens_per_s": cost.tokens / compute_s if compute_s else None,
        "roofline_tokens_per_s": cost.tokens / bound_s,
        "bound": "compute" if compute_s and compute_s > bw_s else "bandwidth",
        "limits": limits.as_dict(),
    }


def as_dict(cost: StepCost) -> dict[str, Any]:
    return {**asdict(cost), "bytes": cost.bytes, "flop": cost.flop}


def run_roofline(engine, result, limits: Limits | float) -> dict[str, Any] | None:
    """The decode roofline of a workload run (``engine run``): its decode-only steps' median batch and
    duration against the roofline of such a step (experts touched as measured over the run, contexts of
    the mean request: prompt plus half its output, host and fetched shares of the expert calls as
    counted over the run). None when the run had no decode-only step."""
    import statistics

    decode = [s for s in result.steps if s.prefill_tokens == 0 and s.decode_tokens > 0]
    done = [r for r in result.requests if r.finish_reason != "rejected"]
    if not decode or not done:
        return None
    batch = int(statistics.median(s.decode_tokens for s in decode))
    step_s = statistics.median(s.duration_ms for s in decode) / 1e3
    context = statistics.fmean(r.prompt_tokens + r.output_tokens / 2 for r in done)
    touched = engine.model.stats.mean_distinct() or None
    if touched is None:
        spec = engine.spec
        touched = spec.n_experts * (1.0 - (1.0 - spec.top_k / spec.n_experts) ** batch)
    hybrid = engine.model.hybrid
    tiers = tier_shares(None, hybrid.stats.as_dict()) if hybrid is not None else None
    if not isinstance(limits, Limits):
        limits = Limits.host(limits)
    r = roofline(step_cost(engine, batch, touched, context, tiers=tiers), limits)
    achieved = batch / step_s
    return {**r, "decode_steps": len(decode), "median_decode_batch": batch, "median_decode_step_ms": step_s * 1e3,
            "decode_tokens_per_s": achieved, "mean_context_tokens": context, "experts_touched_per_layer": touched,
            "mem_bw_gb_per_s": limits.read_gbps, "roofline_fraction": achieved / r["roofline_tokens_per_s"]}
