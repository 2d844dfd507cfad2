"""Routing pruning: a top-k override and skipping experts whose normalised gate weight is small.

This numpy function is the reference the engine's torch version is tested against. Per token (row):

1. ``top_k_override`` keeps the ``k'`` largest gate weights of the router's ``K`` (ties: earlier slot).
2. Each kept weight is normalised by the sum of the kept weights; experts whose normalised weight is
   below ``min_gate_weight`` are skipped, except that the largest one (top-1) is always kept.
3. The surviving weights are rescaled so their sum equals the sum of all ``K`` input weights, which
   keeps the model's own scale: 1 for models that renormalise top-k (Mixtral, OLMoE; so a top-k
   override then matches the model run natively with the smaller k), the router's top-K probability
   mass for those that do not (Qwen-MoE with ``norm_topk_prob=false``).

Shapes never change: skipped slots get weight 0 and expert id :data:`NO_EXPERT` and ``mask`` False.
Arithmetic is in float32 (or the input's wider float type), as the engine's torch mirror does.
"""

from __future__ import annotations

import numpy as np

NO_EXPERT = -1
"""Expert id of a skipped slot (the router trace's convention)."""


def prune_routes(weights: np.ndarray, ids: np.ndarray, top_k_override: int | None = None,
                 min_gate_weight: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prune ``[T, K]`` routes; returns ``(weights [T, K], ids [T, K], mask [T, K] bool)`` (see module doc).

    ``weights`` keep their dtype; ``ids`` keep theirs, with :data:`NO_EXPERT` in skipped slots.
    """
    w_in = np.asarray(weights)
    id_in = np.asarray(ids)
    if w_in.ndim != 2 or id_in.shape != w_in.shape:
        raise ValueError(f"weights and ids must both be [n_tokens, top_k], got {list(w_in.shape)} and "
                         f"{list(id_in.shape)}")
    t, k = w_in.shape
    if top_k_override is not None and (isinstance(top_k_override, bool) or int(top_k_override) != top_k_override
                                       or not 1 <= top_k_override <= k):
        raise ValueError(f"top_k_override must be an integer in [1, {k}] (the router's top-k), got {top_k_override!r}")
    min_w = float(min_gate_weight)
    if not np.isfinite(min_w) or not 0.0 <= min_w <= 1.0:
        raise ValueError(f"min_gate_weight must lie in [0, 1], got {min_gate_weight!r}")
    dtype = np.result_type(w_in.dtype, np.float32)
    w = w_in.astype(dtype)
    if t == 0 or k == 0:
        return w_in.copy(), id_in.copy(), np.zeros(w_in.shape, bool)
    order = np.argsort(-w, axis=1, kind="stable")  # slots by weight, descending; ties: earlier slot
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(k)[None, :].repeat(t, axis=0), axis=1)
    keep_k = k if top_k_override is None else int(top_k_override)
    mask = rank < keep_k
    kept_sum = np.where(mask, w, 0).sum(axis=1, keepdims=True, dtype=dtype)
    if min_w > 0:
        safe = np.where(kept_sum > 0, kept_sum, 1)
        normalised = w / safe
        mask &= (normalised >= dtype.type(min_w)) | (rank == 0)
    else:
        mask |= rank == 0
    row_sum = w.sum(axis=1, keepdims=True, dtype=dtype)
    surviving = np.where(mask, w, 0).sum(axis=1, keepdims=True, dtype=dtype)
    scale = np.where(surviving > 0, row_sum / np.where(surviving > 0, surviving, 1), 1)
    out_w = np.where(mask, w * scale, 0).astype(w_in.dtype)
    out_ids = np.where(mask, id_in, NO_EXPERT).astype(id_in.dtype)
    return out_w, out_ids, mask
