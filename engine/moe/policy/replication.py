"""Extra copies of overloaded experts, and how an expert's tokens are split across its copies.

Pure and deterministic (numpy and the standard library). An expert is overloaded when its share of a
layer's routed tokens over a recent window exceeds ``threshold`` times the mean share (``1 / E``); it
gets replicas so that each copy's share comes down to at most that level, up to ``max_replicas``,
within the layer's spare fast-tier bytes (dynamic expert replication; vLLM/SGLang EPLB).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import numpy as np


def plan_replicas(recent_counts: np.ndarray, threshold: float, max_replicas: int,
                  spare_bytes_per_layer: np.ndarray | Sequence[int], bytes_per_replica: int, *,
                  eligible: Sequence[Collection[int]] | None = None) -> dict[int, dict[int, int]]:
    """Replicas per overloaded expert: ``{layer: {expert: n_replicas}}`` (every layer has a key).

    ``recent_counts`` ``[L, E]``: routed tokens per expert over a recent window. An expert with
    ``count > threshold * mean_count`` wants ``ceil(count / (threshold * mean_count)) - 1`` replicas
    (so each of its copies carries at most ``threshold`` times the mean), capped at ``max_replicas``.
    Replicas cost ``bytes_per_replica`` each and a layer gets at most
    ``spare_bytes_per_layer[l] // bytes_per_replica`` of them. They are handed out one at a time to the
    expert whose tokens per copy are highest (ties: lower id), so the most overloaded are served first.
    ``eligible[l]``, when given, limits layer ``l`` to those experts (e.g. the resident ones).
    """
    counts = np.asarray(recent_counts, dtype=np.float64)
    if counts.ndim != 2:
        raise ValueError(f"recent_counts must be [n_layers, n_experts], got shape {list(counts.shape)}")
    if counts.size and (not np.all(np.isfinite(counts)) or counts.min() < 0):
        raise ValueError("recent_counts must be finite and >= 0")
    n_layers, n_experts = counts.shape
    if isinstance(threshold, bool) or not math.isfinite(float(threshold)) or float(threshold) <= 0:
        raise ValueError(f"threshold must be a finite number > 0, got {threshold!r}")
    if isinstance(max_replicas, bool) or int(max_replicas) != max_replicas or max_replicas < 0:
        raise ValueError(f"max_replicas must be an integer >= 0, got {max_replicas!r}")
    if isinstance(bytes_per_replica, bool) or int(bytes_per_replica) != bytes_per_replica or bytes_per_replica < 1:
        raise ValueError(f"bytes_per_replica must be an integer >= 1, got {bytes_per_replica!r}")
    spare = np.asarray(spare_bytes_per_layer)
    if spare.shape != (n_layers,) or (spare.size and spare.min() < 0):
        raise ValueError(f"spare_bytes_per_layer must be [{n_layers}] values >= 0, got shape {list(spare.shape)}")
    if eligible is not None and len(eligible) != n_layers:
        raise ValueError(f"eligible has {len(eligible)} entries, expected {n_layers}")
    out: dict[int, dict[int, int]] = {}
    for layer in range(n_layers):
        out[layer] = {}
        row = counts[layer]
        total = row.sum()
        slots = min(int(spare[layer]) // int(bytes_per_replica), int(max_replicas) * n_experts)
        if total <= 0 or slots <= 0 or max_replicas == 0:
            continue
        limit = float(threshold) * total / n_experts  # tokens per copy an expert may carry
        allowed = np.ones(n_experts, bool) if eligible is None else np.isin(
            np.arange(n_experts), np.fromiter((int(e) for e in eligible[layer]), np.int64))
        want = np.zeros(n_experts, np.int64)
        over = allowed & (row > limit)
        want[over] = np.minimum(np.ceil(row[over] / limit).astype(np.int64) - 1, int(max_replicas))
        want[over] = np.maximum(want[over], 1)
        # Handing replicas out one at a time to the highest tokens per copy (ties: lower id) takes the
        # ``slots`` highest of every wanted copy's ``count / k`` (k = 1..want: decreasing per expert).
        experts = np.repeat(np.arange(n_experts), want)
        k = np.arange(len(experts)) - np.repeat(np.cumsum(want) - want, want) + 1
        per_copy = row[experts] / k
        taken = experts[np.lexsort((experts, -per_copy))[:slots]]
        given = np.bincount(taken, minlength=n_experts)
        out[layer] = {int(e): int(given[e]) for e in np.flatnonzero(given)}
    return out


def split_tokens(n_tokens: int, n_copies: int, weights: Sequence[float] | None = None) -> list[int]:
    """Token counts for ``n_copies`` copies of an expert, summing to ``n_tokens``; copy ``i`` takes the
    next contiguous run of the expert's tokens (see :func:`split_slices`).

    Near-equal by default (the first ``n_tokens % n_copies`` copies take one more); with ``weights``
    (e.g. each copy's measured throughput, host and device together) proportional to them, the
    leftover tokens going to the largest remainders (lower index on ties).
    """
    if isinstance(n_tokens, bool) or int(n_tokens) != n_tokens or n_tokens < 0:
        raise ValueError(f"n_tokens must be an integer >= 0, got {n_tokens!r}")
    if isinstance(n_copies, bool) or int(n_copies) != n_copies or n_copies < 1:
        raise ValueError(f"n_copies must be an integer >= 1, got {n_copies!r}")
    n, c = int(n_tokens), int(n_copies)
    if weights is None:
        q, r = divmod(n, c)
        return [q + 1] * r + [q] * (c - r)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (c,) or not np.all(np.isfinite(w)) or w.min() < 0 or w.sum() <= 0:
        raise ValueError(f"weights must be {c} finite values >= 0 with a positive sum")
    ideal = w / w.sum() * n
    out = np.floor(ideal).astype(np.int64)
    left = n - int(out.sum())
    order = np.lexsort((np.arange(c), -(ideal - out)))
    out[order[:left]] += 1
    return [int(x) for x in out]


def split_slices(n_tokens: int, n_copies: int, weights: Sequence[float] | None = None) -> list[slice]:
    """:func:`split_tokens` as contiguous slices of the expert's ``n_tokens`` tokens, in copy order."""
    bounds = np.concatenate([[0], np.cumsum(split_tokens(n_tokens, n_copies, weights))]).tolist()
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
