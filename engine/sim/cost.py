"""Seconds of each operation of a step, priced from a :class:`~engine.sim.profile.Profile`.

Two sources, in this order:

1. a measured table of the profile (``engine calibrate``): seconds against tokens (or batch and
   context) for the operation at its calibration shape, interpolated in log-log space and scaled to
   the asked shape by its bytes (bandwidth-bound) or FLOP (compute-bound), whichever binds;
2. a roofline with fitted efficiencies: ``overhead + max(bytes / (bandwidth x bw_efficiency),
   FLOP / (peak x compute_efficiency))``.

Every function is pure: shapes and counts in, seconds out. Which operations overlap is decided by the
step pricer (:mod:`engine.sim.step`), not here.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sim.profile import WEIGHT_BYTES, Link, Processor

# int4 weights carry a bf16 scale and zero point per group of (usually) 128 inputs; int8 a bf16 scale
# per row: bytes per weight including them.
_SCALE_BYTES_PER_WEIGHT = {"int4": 4.0 / 128, "int8": 0.0}


def weight_bytes(n_weights: float, precision: str) -> float:
    """Bytes read for ``n_weights`` weights stored in ``precision``, scales included."""
    return n_weights * (WEIGHT_BYTES[precision] + _SCALE_BYTES_PER_WEIGHT.get(precision, 0.0))


@dataclass(frozen=True)
class OpCost:
    """One priced operation: seconds and what bound it (for explanations and validation)."""

    seconds: float
    bound: str  # "bandwidth" | "compute" | "table" | "overhead"


def roofline_s(proc: Processor, n_bytes: float, flops: float, precision: str, threads_share: float = 1.0) -> OpCost:
    """The roofline time of one operation on ``proc`` (``threads_share``: the share of its cores or SMs)."""
    share = max(threads_share, 1e-6)
    bw_s = n_bytes / (proc.mem_bw_bytes_per_s * proc.bw_efficiency * min(1.0, share * 2))  # bandwidth saturates early
    fl_s = flops / (proc.peak(precision) * proc.compute_efficiency * share)
    return OpCost(max(bw_s, fl_s), "bandwidth" if bw_s >= fl_s else "compute")


def matmul_s(proc: Processor, tokens: int, n: int, k: int, precision: str, threads_share: float = 1.0,
             table: str | None = None) -> OpCost:
    """``tokens`` rows times an ``[n, k]`` weight in ``precision``: a measured table where the profile has
    one (scaled from its calibration shape by weight bytes), else the roofline."""
    if tokens <= 0:
        return OpCost(0.0, "overhead")
    w_bytes = weight_bytes(n * k, precision)
    act_bytes = 4.0 * tokens * (n + k)
    t = proc.tables.get(table or f"matmul:{precision}")
    if t is not None and t.shape.get("n") and t.shape.get("k"):
        scale = (n * k) / (t.shape["n"] * t.shape["k"])
        return OpCost(t.at(tokens) * scale / max(threads_share, 1e-6), "table")
    return roofline_s(proc, w_bytes + act_bytes, 2.0 * tokens * n * k, precision, threads_share)


def expert_s(proc: Processor, tokens: int, hidden: int, inter: int, precision: str,
             threads_share: float = 1.0) -> OpCost:
    """One SwiGLU expert (gate+up [2I, H], down [H, I]) over ``tokens`` tokens."""
    if tokens <= 0:
        return OpCost(0.0, "overhead")
    t = proc.tables.get(f"expert:{precision}")
    if t is not None and t.shape.get("hidden") and t.shape.get("inter"):
        scale = (hidden * inter) / (t.shape["hidden"] * t.shape["inter"])
        return OpCost(t.at(tokens) * scale / max(threads_share, 1e-6), "table")
    n_w = 3.0 * hidden * inter
    return roofline_s(proc, weight_bytes(n_w, precision) + 4.0 * tokens * (3 * hidden + 3 * inter),
                      2.0 * tokens * n_w, precision, threads_share)


def attention_decode_s(proc: Processor, batch: int, kv_tokens: int, n_layers: int, n_heads: int, n_kv_heads: int,
                       head_dim: int, kv_bytes_per_value: float = 4.0) -> OpCost:
    """Decode attention of ``batch`` sequences over ``kv_tokens`` cached tokens in all: reads every cached
    key and value once per layer (bandwidth-bound), 4 FLOP per head, position and dimension."""
    if batch <= 0:
        return OpCost(0.0, "overhead")
    t = proc.tables.get("attention_decode")
    kv_bytes = 2.0 * n_layers * kv_tokens * n_kv_heads * head_dim * kv_bytes_per_value
    if t is not None and t.shape.get("kv_values_per_token"):
        per_value = t.at(max(kv_tokens, 1)) / (t.shape["kv_values_per_token"] * max(t.shape.get("layers", 1), 1))
        return OpCost(per_value * n_layers * n_kv_heads * head_dim * 2, "table")
    flops = 4.0 * n_layers * kv_tokens * n_heads * head_dim
    return roofline_s(proc, kv_bytes, flops, "fp32")


def attention_prefill_s(proc: Processor, tokens: int, context: int, n_layers: int, n_heads: int, head_dim: int,
                        precision: str = "fp32") -> OpCost:
    """Prefill attention of a chunk of ``tokens`` new tokens over ``context`` tokens (causal: each new token
    attends to about ``context - tokens / 2`` positions): compute-bound."""
    if tokens <= 0:
        return OpCost(0.0, "overhead")
    avg = max(context - tokens / 2.0, 1.0)
    flops = 4.0 * n_layers * tokens * avg * n_heads * head_dim
    return roofline_s(proc, 0.0, flops, precision)


def transfer_s(link: Link, n_bytes: float, direction: str = "h2d", pinned: bool = True) -> float:
    """One host <-> device copy of ``n_bytes``: the link's latency plus bytes over its bandwidth."""
    if n_bytes <= 0:
        return 0.0
    if direction == "h2d":
        bw = link.h2d_pinned_bytes_per_s if pinned else link.h2d_pageable_bytes_per_s
    elif direction == "d2h":
        bw = link.d2h_pinned_bytes_per_s if pinned else link.d2h_pageable_bytes_per_s
    else:
        raise ValueError(f"direction={direction!r}: must be 'h2d' or 'd2h'")
    return link.latency_s + n_bytes / bw


def threads_share(proc: Processor, threads: int) -> float:
    """Relative speed of ``threads`` of the host's cores against all of them: measured where the profile
    has ``thread_scaling`` (nearest measured count at or below), else linear in cores."""
    if not proc.cores or threads <= 0 or threads >= proc.cores:
        return 1.0
    if proc.thread_scaling:
        counts = sorted((int(k), v) for k, v in proc.thread_scaling.items())
        below = [v for c, v in counts if c <= threads]
        return below[-1] if below else counts[0][1] * threads / counts[0][0]
    return threads / proc.cores
