"""Statistics of a workload: arrivals, lengths, tags, prefix reuse and, with a router trace, expert skew."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from workloads.schema import Workload

PERCENTILES = (50, 90, 99)


def length_stats(lengths: np.ndarray) -> dict[str, float | int | None]:
    """Mean, min, max and p50/p90/p99 of token lengths (None for an empty array)."""
    if lengths.size == 0:
        return {"mean": None, "min": None, "max": None, **{f"p{p}": None for p in PERCENTILES}}
    out: dict[str, float | int | None] = {"mean": round(float(lengths.mean()), 3), "min": int(lengths.min()),
                                          "max": int(lengths.max())}
    for p in PERCENTILES:
        out[f"p{p}"] = round(float(np.percentile(lengths, p)), 3)
    return out


def prefix_reuse(workload: Workload) -> float | None:
    """Share of hash-named prompt blocks already seen in an earlier request (upper bound on prefix-cache hits).

    None when no request carries ``hash_ids``.
    """
    seen: set[int] = set()
    total = reused = 0
    for request in workload.requests:
        for block in request.hash_ids or ():
            total += 1
            reused += block in seen
            seen.add(block)
    return reused / total if total else None


def workload_stats(workload: Workload, window_tokens: int | None = None) -> dict[str, Any]:
    """Everything ``workloads show`` reports, as JSON-ready values."""
    gaps = np.diff(workload.arrivals_s)
    stats: dict[str, Any] = {
        "name": workload.name,
        "n_requests": len(workload),
        "duration_s": round(workload.duration_s, 6),
        "rate_per_s": None if workload.rate_per_s is None else round(workload.rate_per_s, 6),
        "burstiness_cv": None if workload.burstiness_cv is None else round(workload.burstiness_cv, 4),
        "max_gap_s": round(float(gaps.max()), 6) if gaps.size else None,
        "prompt_len": length_stats(workload.prompt_lens),
        "output_len": length_stats(workload.output_lens),
        "total_prompt_tokens": workload.total_prompt_tokens,
        "total_output_tokens": workload.total_output_tokens,
        "tags": dict(Counter(r.tag for r in workload.requests if r.tag is not None).most_common()),
        "with_prompt_ids": sum(r.prompt_ids is not None for r in workload.requests),
        "with_hash_ids": sum(r.hash_ids is not None for r in workload.requests),
        "prefix_reuse": prefix_reuse(workload),
        "source": workload.metadata.get("source"),
        "router": None,
    }
    trace = workload.router_trace
    if trace is not None:
        stats["router"] = {"model_identity": trace.model_identity, "moe_layers": trace.model_identity["moe_layers"],
                           "n_experts": trace.n_experts, "top_k": trace.top_k,
                           **trace.skew_stats(window_tokens)}
    return stats


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_stats(stats: dict[str, Any]) -> str:
    """A readable multi-line table of :func:`workload_stats`."""
    rate = stats["rate_per_s"]
    lines = [
        f"workload      {stats['name']}" + (f"  ({stats['source']})" if stats["source"] else ""),
        f"requests      {stats['n_requests']}",
        f"duration      {_fmt(stats['duration_s'])} s",
        f"rate          {_fmt(rate)} req/s" if rate is not None else "rate          all requests arrive at once",
        f"burstiness    CV of gaps {_fmt(stats['burstiness_cv'])} (1 = Poisson)",
        "",
        f"{'tokens':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'min':>8}{'max':>8}{'total':>12}",
    ]
    for key, total in (("prompt_len", "total_prompt_tokens"), ("output_len", "total_output_tokens")):
        s = stats[key]
        lines.append(f"{key.replace('_len', ''):<12}{_fmt(s['mean'], 1):>10}{_fmt(s['p50'], 0):>10}"
                     f"{_fmt(s['p90'], 0):>10}{_fmt(s['p99'], 0):>10}{_fmt(s['min']):>8}{_fmt(s['max']):>8}"
                     f"{stats[total]:>12}")
    if stats["tags"]:
        lines += ["", "tags          " + ", ".join(f"{tag} ({n})" for tag, n in stats["tags"].items())]
    if stats["prefix_reuse"] is not None:
        lines.append(f"prefix reuse  {stats['prefix_reuse']:.1%} of 512-token blocks seen before")
    if stats["with_prompt_ids"]:
        lines.append(f"prompt ids    {stats['with_prompt_ids']} requests carry real token ids")
    router = stats["router"]
    if router is not None:
        ident = router["model_identity"]
        lines += ["", f"router trace  {router['n_requests']} requests, {router['n_tokens']} tokens; model "
                  f"{ident['arch']} ({ident['fingerprint'][:24]}), top-{router['top_k']} of {router['n_experts']}",
                  f"drift         mean TV distance {_fmt(router['mean_drift_tv'], 3)} between "
                  f"{router['n_windows']} windows of {router['window_tokens']} tokens",
                  f"{'layer':>7}{'top-10% share':>16}{'entropy':>10}{'drift':>9}"]
        for layer, top, entropy, drift in zip(router["moe_layers"], router["top10_share"], router["entropy_norm"],
                                              router["drift_tv"], strict=True):
            lines.append(f"{layer:>7}{top:>16.3f}{entropy:>10.3f}{drift:>9.3f}")
    return "\n".join(lines)
