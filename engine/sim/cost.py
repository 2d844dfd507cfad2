"""Seconds of each operation of a step, priced from a :class:`~engine.sim.profile.Processor`.

Two sources, in this order:

1. a measured table of the profile (``engine calibrate``): seconds against tokens (or batch and
   context) for the operation at its calibration shape, interpolated in log-log space and scaled to
   the asked shape by its weight elements (the work of a product, bandwidth- or compute-bound, grows
   with them; the fixed part of a call scales too, a small error where shapes differ much);
2. a roofline with the profile's efficiencies: ``max(bytes / (bandwidth x bw_efficiency),
   FLOP / (peak x compute_efficiency))`` plus ``call_overhead_s`` per call.

Every function is pure: shapes and counts in, seconds out; the ``*_lut`` functions return seconds
for every token count ``0..n`` at once (the step pricer indexes them per expert). Which operations
overlap is decided by the step pricer (:mod:`engine.sim.step`), not here.
"""

from __future__ import annotations

import numpy as np

from engine.precision import FLOAT_BYTES, expert_nbytes, weight_nbytes
from engine.sim.profile import Grid, Interconnect, Link, Processor, Table

ACT_BYTES = 4.0
"""Bytes of one activation value the roofline counts (fp32 activations; a small term beside weights)."""


def bw_share(share: float) -> float:
    """Share of a processor's memory bandwidth a share of its cores or SMs reaches: bandwidth saturates
    with about half of them (an assumption where the profile has no ``sm_scaling`` or
    ``thread_scaling``)."""
    return min(1.0, 2.0 * max(share, 1e-6))


def roofline_s(proc: Processor, n_bytes: float, flops: float, precision: str, share: float = 1.0) -> float:
    """The roofline time of one operation on ``proc`` given ``share`` of its cores or SMs."""
    bw_s = n_bytes / (proc.mem_bw_bytes_per_s * proc.bw_efficiency * bw_share(share))
    fl_s = flops / (proc.peak(precision) * proc.compute_efficiency * max(share, 1e-6))
    return max(bw_s, fl_s)


def _log_lut(table: Table, n: int) -> np.ndarray:
    """``table.at(k)`` for k = 0..n as an array (k = 0 costs nothing); vectorised log-log interpolation
    with the last segment's slope (held within [0, 1]) beyond the last point and a constant below
    the first (as :meth:`~engine.sim.profile.Table.at`)."""
    out = np.zeros(n + 1)
    if n < 1:
        return out
    k = np.arange(1, n + 1, dtype=np.float64)
    lx, ly = np.log(np.asarray(table.x)), np.log(np.asarray(table.seconds))
    if len(lx) == 1:
        out[1:] = table.seconds[0]
        return out
    vals = np.interp(np.log(k), lx, ly)
    beyond = k > table.x[-1]
    if beyond.any():
        slope = min(1.0, max(0.0, (ly[-1] - ly[-2]) / (lx[-1] - lx[-2])))
        vals[beyond] = ly[-1] + slope * (np.log(k[beyond]) - lx[-1])
    out[1:] = np.exp(vals)
    return out


def table_scale(table: Table | Grid, **shape: int) -> float:
    """How much larger the asked operation is than the measured one, by the product of the shape
    entries both name (weight elements); 1 where the table carries no shape."""
    num = den = 1.0
    for key, value in shape.items():
        if key in table.shape:
            num *= value
            den *= table.shape[key]
    return num / den


def expert_lut(proc: Processor, hidden: int, inter: int, precision: str, compute: str, n_max: int, *,
               fused: bool = False, group: int = 128, native: bool = True) -> np.ndarray:
    """Seconds of one SwiGLU expert (gate+up [2I, H], down [H, I]) over k = 0..n_max tokens.

    ``fused``: inside one fused call for a whole layer (``expert_fused:`` table; the call's own cost is
    :func:`moe_call_lut`), else on the per-expert path (``expert:`` table, or the roofline plus
    ``call_overhead_s``). At full speed: the step pricer divides by the speed of a share of threads or SMs.
    """
    key = f"{'expert_fused' if fused else 'expert'}:{precision}@{compute}"
    t = proc.tables.get(f"expert_torch:{precision}@{compute}") if not native and not fused else None
    t = t or proc.tables.get(key)  # ``expert_torch:``: the products without the CPU engine's native kernels
    if isinstance(t, Table):
        return _log_lut(t, n_max) * table_scale(t, hidden=hidden, inter=inter)
    k = np.arange(n_max + 1, dtype=np.float64)
    w_bytes = expert_nbytes(hidden, inter, precision, group)
    flops = 2.0 * k * 3 * hidden * inter
    act = ACT_BYTES * k * (3 * hidden + 3 * inter)
    bw = proc.mem_bw_bytes_per_s * proc.bw_efficiency
    fl = proc.peak(precision) * proc.compute_efficiency
    out = np.maximum((w_bytes + act) / bw, flops / fl) + (0.0 if fused else proc.call_overhead_s)
    out[0] = 0.0
    return out


def matmul_lut(proc: Processor, n: int, k: int, precision: str, compute: str, t_max: int) -> np.ndarray:
    """Seconds of ``t`` rows times one ``[n, k]`` weight in ``precision``, for t = 0..t_max: the
    ``matmul:`` table scaled by weight elements, else the roofline plus ``call_overhead_s``."""
    t = proc.tables.get(f"matmul:{precision}@{compute}")
    if isinstance(t, Table):
        return _log_lut(t, t_max) * table_scale(t, n=n, k=k)
    rows = np.arange(t_max + 1, dtype=np.float64)
    w_bytes = weight_nbytes(n, k, precision, 128) if precision != "int4" else n * k / 2
    bw = proc.mem_bw_bytes_per_s * proc.bw_efficiency
    fl = proc.peak(precision) * proc.compute_efficiency
    out = np.maximum((w_bytes + ACT_BYTES * rows * (n + k)) / bw, 2.0 * rows * n * k / fl) + proc.call_overhead_s
    out[0] = 0.0
    return out


def moe_call_lut(proc: Processor, hidden: int, compute: str, n_max: int, *, fused: bool) -> np.ndarray:
    """Fixed work of one MoE layer call over k = 0..n_max (tokens for a fused call, routed slots for the
    per-expert path: gathering, combining): the ``moe_fused_call`` / ``moe_grouped_call`` table scaled
    by the hidden size, else the activations' bytes at memory bandwidth."""
    t = proc.tables.get(f"{'moe_fused_call' if fused else 'moe_grouped_call'}@{compute}")
    if isinstance(t, Table):
        out = _log_lut(t, n_max) * table_scale(t, hidden=hidden)
        out[0] = 0.0
        return out
    k = np.arange(n_max + 1, dtype=np.float64)
    return 3.0 * ACT_BYTES * k * hidden / (proc.mem_bw_bytes_per_s * proc.bw_efficiency)


def attention_decode_s(proc: Processor, batch: int, mean_kv: float, n_heads: int, n_kv_heads: int, head_dim: int,
                       compute: str, *, mixed: bool = False) -> float:
    """One layer's decode attention of ``batch`` sequences whose KV caches hold ``mean_kv`` tokens on
    average: the ``attention_decode`` grid (``attention_decode_mixed`` in steps that also prefill, where
    the engine takes another path) scaled by KV width, else every cached key and value read once."""
    if batch <= 0:
        return 0.0
    t = proc.tables.get(f"attention_decode_mixed@{compute}") if mixed else None
    t = t or proc.tables.get(f"attention_decode@{compute}")
    if isinstance(t, Grid):
        return t.at(batch, max(mean_kv, 1.0)) * table_scale(t, n_kv_heads=n_kv_heads, head_dim=head_dim)
    kv_bytes = 2.0 * batch * mean_kv * n_kv_heads * head_dim * FLOAT_BYTES.get(compute, 4)
    flops = 4.0 * batch * mean_kv * n_heads * head_dim
    return roofline_s(proc, kv_bytes, flops, compute) + proc.call_overhead_s


def attention_prefill_s(proc: Processor, tokens: int, context: int, n_heads: int, n_kv_heads: int, head_dim: int,
                        compute: str) -> float:
    """One layer's attention of a prompt chunk of ``tokens`` new tokens over ``context`` tokens in all
    (causal: each new token attends to about ``context - tokens / 2`` positions): the
    ``attention_prefill`` grid scaled by head width, else the roofline (compute-bound)."""
    if tokens <= 0:
        return 0.0
    t = proc.tables.get(f"attention_prefill@{compute}")
    if isinstance(t, Grid):
        return t.at(tokens, max(context, tokens)) * table_scale(t, n_heads=n_heads, head_dim=head_dim)
    avg = max(context - tokens / 2.0, 1.0)
    kv_bytes = 2.0 * context * n_kv_heads * head_dim * FLOAT_BYTES.get(compute, 4)
    return roofline_s(proc, kv_bytes, 4.0 * tokens * avg * n_heads * head_dim, compute) + proc.call_overhead_s


def build_copy_s(proc: Processor, hidden: int, inter: int, precision: str, source_bytes: int, group: int = 128) -> float:
    """Seconds to build one expert's copy in ``precision`` from its host copy of ``source_bytes``
    within ``proc``'s memory: a copy for float precisions, a quantisation (``quantize:`` table, per
    weight element of the measured shape) for int8/int4."""
    if precision in FLOAT_BYTES:
        return source_bytes / proc.copy_bw + expert_nbytes(hidden, inter, precision, group) / proc.copy_bw
    t = proc.tables.get(f"quantize:{precision}")
    if isinstance(t, Table):
        return t.at(1) * table_scale(t, hidden=hidden, inter=inter)
    # Without a measurement: a few passes over the float weights (read, scale search, write).
    return 4.0 * source_bytes / proc.copy_bw


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


def all_reduce_s(inter: Interconnect, n_bytes_per_rank: float, n_ranks: int) -> float:
    """One ring all-reduce across ``n_ranks`` devices in which each rank sends ``n_bytes_per_rank``
    (:func:`~engine.moe.policy.placement.step_traffic`'s combine figure): ``2 (N - 1)`` hops of the
    interconnect's latency plus the bytes over its bandwidth per direction (every rank sends and
    receives at once, so the ring's time is one rank's bytes over one link)."""
    if n_ranks <= 1 or n_bytes_per_rank <= 0:
        return 0.0
    return 2 * (n_ranks - 1) * inter.latency_s + n_bytes_per_rank / inter.bytes_per_s


def relative_speed(points: dict[float, float], at: float, default: float) -> float:
    """Speed at ``at`` from measured ``{x: speed}`` points: linear interpolation between them, the
    nearest point's speed outside; ``default`` where nothing was measured."""
    if not points:
        return default
    xs = sorted(points)
    if at <= xs[0]:
        return points[xs[0]]
    if at >= xs[-1]:
        return points[xs[-1]]
    i = next(j for j in range(len(xs) - 1) if xs[j] <= at <= xs[j + 1])
    a, b = xs[i], xs[i + 1]
    return points[a] + (points[b] - points[a]) * (at - a) / (b - a)


def thread_speed(proc: Processor, threads: int) -> float:
    """Speed with ``threads`` host threads (0: every core) relative to the threads the profile was
    measured with: ``thread_scaling`` (speeds relative to that count), else linear in threads."""
    base = proc.threads or proc.cores or 1
    n = (proc.cores or base) if threads <= 0 else threads
    if proc.cores:
        n = min(n, proc.cores)
    if n == base:
        return 1.0
    return relative_speed(proc.thread_scaling, n, n / base)


def sm_speed(proc: Processor, share: float) -> float:
    """Speed of expert products with ``share`` of the SMs, relative to all of them (``sm_scaling``,
    else the roofline's assumption: bandwidth-bound products keep full speed down to half the SMs)."""
    if share >= 1.0:
        return 1.0
    return relative_speed(proc.sm_scaling, share, bw_share(share)) if proc.sm_scaling else bw_share(share)


def fit_linear(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` with a, b >= 0 (used by calibration fits)."""
    x, y = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
    if len(x) < 2 or np.ptp(x) == 0:
        return float(max(y.mean(), 0.0)), 0.0
    b, a = np.polyfit(x, y, 1)
    if b < 0:
        return float(max(y.mean(), 0.0)), 0.0
    if a < 0:
        return 0.0, float(max((x * y).sum() / (x * x).sum(), 0.0))
    return float(a), float(b)

