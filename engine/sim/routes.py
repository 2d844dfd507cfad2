"""Synthetic routing for the simulator, when the workload has no router trace.

Each token's experts at every MoE layer come from a pool of routed tokens drawn once with the
model's hotness: :func:`workloads.synth.synth_router_trace` (Zipf-like popularity per layer with
``skew``, token-by-token correlation between consecutive layers), ``pool_tokens`` tokens. A token
takes one pool row (all layers together, so the correlation between layers is kept), picked by a
hash of its request and position: the same token routes the same way in every config, so configs
compare on the same routing.

The hot set drifts over time (DynaExq's case): "time" is the order of the tokens of the requests in
the order they are added (their arrival order), as a recorded trace's tokens are. Every
``drift_window_tokens`` tokens, at each MoE layer, ``drift`` of the experts (by popularity: hot ones
are picked as often as they are routed) trade their popularity with a random expert, so the hottest
experts of one window may be cold a few windows later. Hotness for static and dynamic residency is
that of the start (what a warm-up would count), so static placement cannot follow the drift.

A step whose plans read only the routed tokens per expert (no micro-batches, prefetch or pruning)
counts them without building the ids (:meth:`SyntheticRoutes.counts_many`): the hash gives a
request's consecutive tokens consecutive rows in one fixed order of the pool, so a prompt chunk
counts as the difference of two prefix sums over the pool in that order.

Pure numpy; the object offers what the backends read of a :class:`~workloads.router.RouterTrace`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from engine.moe.policy.routing import NO_EXPERT
from workloads.router import SYNTHETIC_PREFIX

_HASH_MUL = 0x9E3779B1  # Knuth's multiplicative hash constant (2^32 / golden ratio)


@dataclass(frozen=True)
class RoutingShape:
    """What a synthetic router needs of the model: MoE layers (indices), experts, top-k."""

    moe_layers: tuple[int, ...]
    n_experts: int
    top_k: int
    n_layers: int
    hidden_size: int = 0


@dataclass(frozen=True)
class SyntheticRouting:
    """The knobs of synthetic routing (``engine run --backend sim --router-skew ...``)."""

    skew: float = 1.0
    """Zipf exponent of expert popularity per layer (0: uniform)."""
    drift: float = 0.1
    """Share of each layer's experts (by popularity) that trade places with a random one per window."""
    drift_window_tokens: int = 4096
    layer_corr: float = 0.5
    pool_tokens: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if self.skew < 0 or not 0 <= self.drift <= 1 or self.drift_window_tokens < 1 or not 0 <= self.layer_corr <= 1:
            raise ValueError(f"synthetic routing: need skew >= 0, 0 <= drift <= 1, drift_window_tokens >= 1 and "
                             f"0 <= layer_corr <= 1; got skew={self.skew}, drift={self.drift}, "
                             f"drift_window_tokens={self.drift_window_tokens}, layer_corr={self.layer_corr}")
        if self.pool_tokens < 16:
            raise ValueError(f"synthetic routing: pool_tokens={self.pool_tokens}: must be >= 16")

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class SyntheticRoutes:
    """Routes of every token of every request added, drawn as the module docstring says."""

    def __init__(self, shape: RoutingShape, routing: SyntheticRouting | None = None) -> None:
        from workloads.schema import Request
        from workloads.synth import synth_router_trace

        self.shape = shape
        self.routing = r = routing or SyntheticRouting()
        pool = synth_router_trace([Request("pool", 0.0, r.pool_tokens, 1)], n_layers=shape.n_layers,
                                  n_experts=shape.n_experts, top_k=shape.top_k, moe_layers=list(shape.moe_layers),
                                  hidden_size=shape.hidden_size, skew=r.skew, drift=0.0,
                                  drift_window_tokens=r.pool_tokens, layer_corr=r.layer_corr, seed=r.seed)
        self.pool_ids = pool.expert_ids  # [P, L, K] int16
        self.pool_gates = pool.gate_weights
        self.n_pool = self.pool_ids.shape[0]
        self._start_hotness = pool.hotness()  # [L, E]
        self._counter = _PoolCounts(self.pool_ids, shape.n_experts)  # shared by every fresh() copy
        self._prunings: dict[tuple[int | None, float], _PrunedPool] = {}  # likewise
        digest = hashlib.sha256(json.dumps({"shape": vars(shape), "routing": r.to_dict()}, sort_keys=True,
                                           default=list).encode()).hexdigest()[:16]
        self.model_identity = {"arch": "synthetic", "n_layers": shape.n_layers, "moe_layers": list(shape.moe_layers),
                               "n_experts": shape.n_experts, "top_k": shape.top_k, "hidden_size": shape.hidden_size,
                               "fingerprint": f"{SYNTHETIC_PREFIX}{digest}", "synthetic": r.to_dict()}
        self._reset()

    def _reset(self) -> None:
        self._win_cache: dict[int, np.ndarray] = {}
        n_moe, e = len(self.shape.moe_layers), self.shape.n_experts
        if getattr(self, "_drift", None) is None:  # one per pool: every fresh() copy reads the same windows
            self._drift = _DriftLabels(n_moe, e, self.routing, self._start_hotness)
        self._base: dict[str, int] = {}  # request -> its first token's time
        self._salt: dict[str, int] = {}
        self._clock = 0

    def fresh(self) -> SyntheticRoutes:
        """The same pool with no request added yet and the drift started afresh (one per run)."""
        other = copy.copy(self)
        other._reset()
        return other

    # -------------------------------------------------------------------------- what backends read
    def __contains__(self, key: object) -> bool:
        return key in self._base

    def check_model(self, identity: Mapping[str, Any], source: str, **_: Any) -> None:
        """Synthetic routes fit any model of their routing shape (they were drawn for it)."""

    def hotness(self) -> np.ndarray:
        """Shares of routed tokens per expert at the start, ``[MoE layers, E]``."""
        return self._start_hotness.copy()

    @property
    def is_synthetic(self) -> bool:
        return True

    def describe(self) -> dict[str, Any]:
        return {"synthetic": True, **self.routing.to_dict(), "fingerprint": self.model_identity["fingerprint"]}

    # --------------------------------------------------------------------------------- routing
    def add(self, key: str, n_tokens: int) -> None:
        """Register a request whose tokens (prompt and generated, fed back) number ``n_tokens``."""
        if key in self._base:
            return
        self._base[key] = self._clock
        self._salt[key] = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")
        self._clock += max(int(n_tokens), 0)

    def forget(self, key: str) -> None:
        self._base.pop(key, None)
        self._salt.pop(key, None)

    def rows(self, key: str, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Expert ids and gate weights ``[n, MoE layers, K]`` of tokens ``start..start+n`` of request ``key``."""
        return self.rows_many([key], [start], [n])

    def rows_many(self, keys: list[str], starts: list[int], counts: list[int], gates: bool = True,
                  prune: tuple[int | None, float] | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """:meth:`rows` of several requests at once, concatenated in the order given (``gates=False``:
        the expert ids alone, gate weights None: what a step without routing pruning reads). ``prune``
        = ``(top_k_override or None, min_gate_weight)``: the ids as
        :func:`~engine.moe.policy.routing.prune_routes` prunes them (:data:`NO_EXPERT` in skipped slots),
        decided once per pool row, and no gate weights."""
        n = np.asarray(counts, dtype=np.int64)
        total = int(n.sum())
        owner = np.repeat(np.arange(len(keys)), n)
        first = np.concatenate([[0], np.cumsum(n)[:-1]])
        pos = np.arange(total, dtype=np.int64) - first[owner] + np.asarray(starts, dtype=np.int64)[owner]
        salt = np.asarray([self._salt[k] for k in keys], dtype=np.uint64)[owner]
        rows = ((pos.astype(np.uint64) * np.uint64(_HASH_MUL) + salt) % np.uint64(self.n_pool)).astype(np.int64)
        gate_rows = self.pool_gates[rows] if gates and prune is None else None
        r = self.routing
        if r.drift <= 0 or not total:
            ids = self.pool_ids[rows]  # [N, L, K]
        else:
            t = np.asarray([self._base[k] for k in keys], dtype=np.int64)[owner] + pos
            win = t // r.drift_window_tokens
            w0, w1 = int(win.min()), int(win.max())
            if w0 == w1:  # one window (the usual case): the pool with that window's labels, mapped once
                ids = self._window_pool(w0)[rows]
            else:
                perms = self._perms_to(w1)
                n_layers, e = perms.shape[1], perms.shape[2]
                # Index of each token's (window, layer) block in the flat permutations, [N, L, 1], then plus
                # the pool's label: one widening add over [N, L, K] (int32 while the blocks fit) and one take.
                wide = np.int32 if perms.size < np.iinfo(np.int32).max else np.int64
                block = (win.astype(wide) * wide(n_layers * e))[:, None, None] \
                    + self._layer_offsets(n_layers, e).astype(wide, copy=False)
                ids = perms.reshape(-1).take(np.add(self.pool_ids[rows], block, dtype=wide))
        if prune is not None:
            ids = np.where(self._pruned(prune).keep[rows], ids, NO_EXPERT).astype(ids.dtype, copy=False)
        return ids, gate_rows

    def counts_many(self, keys: list[str], starts: list[int], counts: list[int],
                    prune: tuple[int | None, float] | None = None) -> np.ndarray:
        """Routed tokens per expert ``[MoE layers, E]`` (int64) of the tokens :meth:`rows_many` routes
        (what :func:`~engine.moe.policy.plan.counts_by_layer` counts of its ids, pruned as ``prune``
        says), without building the ids.

        A request's consecutive tokens take consecutive pool rows in the order of the hash's stride
        (``row = (pos x mul + salt) mod P`` steps by ``mul mod P``), so a long run of tokens within one
        drift window counts as the difference of two prefix sums over the pool in that order, in the
        pool's labels, then relabelled by the window; short runs (decode tokens) are gathered and counted."""
        pc = self._counter if prune is None else self._pruned(prune).counter
        n_moe, e = len(self.shape.moe_layers), self.shape.n_experts
        width = n_moe * e + 1  # the last bin holds skipped slots
        acc = np.zeros(width, np.int64)
        r = self.routing
        window_tokens = r.drift_window_tokens if r.drift > 0 else None
        short: list[tuple[int, int, int, int]] = []  # (start, n, salt, first token's time) of short runs
        for key, start, n in zip(keys, starts, counts, strict=True):
            if n <= 0:
                continue
            salt = self._salt[key]
            t0 = self._base[key] + start
            if n < pc.long_tokens:
                short.append((start, n, salt, t0))
                continue
            at, left, pos = 0, n, start
            while left:  # one piece per drift window the run crosses
                if window_tokens is None:
                    w, take = 0, left
                else:
                    w = (t0 + at) // window_tokens
                    take = min(left, (w + 1) * window_tokens - (t0 + at))
                c0, rest = pc.run_counts(pc.cyclic_index(pos, salt), take)  # [L x E + 1] in the pool's labels
                if c0 is not None and window_tokens is None:
                    acc += c0
                elif c0 is not None:
                    acc[self._drift.flat_labels(w)] += c0  # a permutation per layer: no index repeats
                short += [(pos + off, length, salt, t0 + at + off) for off, length in rest]  # the run's ends
                at, left, pos = at + take, left - take, pos + take
        if short:
            start_a, n_a, salt_a, t0_a = (np.asarray(c, dtype=np.int64) for c in zip(*short, strict=True))
            total = int(n_a.sum())
            if total == len(short):  # one token each (decode)
                pos, t, salt_of = start_a, t0_a, salt_a
            else:
                owner = np.repeat(np.arange(len(short)), n_a)
                step = np.arange(total, dtype=np.int64) - (np.cumsum(n_a) - n_a)[owner]
                pos, t, salt_of = start_a[owner] + step, t0_a[owner] + step, salt_a[owner]
            rows = ((pos.astype(np.uint64) * np.uint64(_HASH_MUL) + salt_of.astype(np.uint64))
                    % np.uint64(self.n_pool)).astype(np.int64)  # as rows_many hashes them
            flat = pc.pool_flat[rows]  # [N, L x K] pool label + layer offset
            if window_tokens is not None:
                win = t // window_tokens
                labels = self._drift.flat_labels_upto(int(win.max()))
                flat = labels.reshape(-1).take(np.add(flat, (win * width)[:, None]))
            acc += np.bincount(flat.reshape(-1), minlength=width)
        return acc[:-1].reshape(n_moe, e)

    def _pruned(self, prune: tuple[int | None, float]) -> _PrunedPool:
        """The pool pruned by ``(top_k_override or None, min_gate_weight)`` (the last few kept: one per config)."""
        from engine.moe.policy.routing import prune_routes

        got = self._prunings.get(prune)
        if got is None:
            p, n_layers, k = self.pool_ids.shape
            keep = prune_routes(self.pool_gates.reshape(p * n_layers, k).astype(np.float32),
                                self.pool_ids.reshape(p * n_layers, k), *prune)[2].reshape(p, n_layers, k)
            got = _PrunedPool(keep, _PoolCounts(np.where(keep, self.pool_ids, NO_EXPERT).astype(self.pool_ids.dtype),
                                                self.shape.n_experts))
            if len(self._prunings) >= 4:
                self._prunings.pop(next(iter(self._prunings)))
            self._prunings[prune] = got
        return got

    def _window_pool(self, window: int) -> np.ndarray:
        """The pool's expert ids ``[P, L, K]`` relabelled by window ``window``'s permutations (cached: the
        last few windows are what the running requests are in)."""
        cache = self.__dict__.setdefault("_win_cache", {})
        got = cache.get(window)
        if got is None:
            perms = self._perms_to(window)
            n_layers, e = perms.shape[1], perms.shape[2]
            got = perms[window].reshape(-1)[self.pool_ids + self._layer_offsets(n_layers, e)]
            if len(cache) >= 8:
                cache.pop(min(cache))
            cache[window] = got
        return got

    def _layer_offsets(self, n_layers: int, n_experts: int) -> np.ndarray:
        if getattr(self, "_offsets", None) is None or self._offsets.shape[1] != n_layers:
            self._offsets = (np.arange(n_layers, dtype=np.int64) * n_experts)[None, :, None]
        return self._offsets

    def _perms_to(self, window: int) -> np.ndarray:
        """Permutations of expert labels ``[windows, L, E]`` up to at least ``window`` (see :class:`_DriftLabels`)."""
        return self._drift.upto(window)

    def drift_tv(self, windows: int = 8) -> float:
        """Mean total-variation distance of hotness between consecutive windows (the drift it makes)."""
        self._perms_to(windows)
        shares = []
        for w in range(windows + 1):
            h = np.zeros_like(self._start_hotness)
            for li in range(h.shape[0]):
                h[li, self._perms_to(windows)[w][li]] = self._start_hotness[li]
            shares.append(h)
        return float(np.mean([0.5 * np.abs(b - a).sum(axis=1).mean() for a, b in zip(shares, shares[1:],
                                                                                        strict=False)]))


class _DriftLabels:
    """Expert labels per drift window, ``[windows, L, E]``: each window trades the popularity of ``drift``
    of each layer's experts (picked by popularity) with random experts.

    Drawn in window order from one seeded stream, so window ``w`` is the same whoever asks for it first:
    the copies :meth:`SyntheticRoutes.fresh` makes (one per run) share one instance and draw each window
    once. Stored in an array that doubles when full (not restacked per new window)."""

    def __init__(self, n_layers: int, n_experts: int, routing: SyntheticRouting, hotness: np.ndarray) -> None:
        self.rng = np.random.default_rng([routing.seed, 7])
        self.n_swap = max(1, round(routing.drift * n_experts)) if routing.drift > 0 else 0
        self.hotness = hotness
        self.arr = np.tile(np.arange(n_experts, dtype=np.int16), (4, n_layers, 1))
        self.n = 1
        width = n_layers * n_experts
        self._flat = np.full((4, width + 1), width, np.int64)  # labels + layer offsets, per window
        self._n_flat = 0
        self._offsets = (np.arange(n_layers, dtype=np.int64) * n_experts)[:, None]

    def flat_labels_upto(self, window: int) -> np.ndarray:
        """``[windows, L x E + 1]`` int64 for windows ``0..n-1`` with ``n > window``: at ``[w, l x E + e]``
        the label ``l x E + perm`` that window ``w`` gives the pool's expert ``e`` of layer ``l``; the
        last column (skipped slots) maps to itself."""
        if window >= self._n_flat:
            labels = self.upto(window)
            if window >= len(self._flat):
                grown = np.full((max(window + 1, 2 * len(self._flat)), self._flat.shape[1]), self._flat.shape[1] - 1,
                                np.int64)
                grown[: self._n_flat] = self._flat[: self._n_flat]
                self._flat = grown
            got = labels[self._n_flat: window + 1]
            self._flat[self._n_flat: window + 1, :-1] = (got + self._offsets).reshape(len(got), -1)
            self._n_flat = window + 1
        return self._flat[: self._n_flat]

    def flat_labels(self, window: int) -> np.ndarray:
        """Row ``window`` of :meth:`flat_labels_upto`."""
        return self.flat_labels_upto(window)[window]

    def upto(self, window: int) -> np.ndarray:
        """The labels of windows ``0..n-1`` with ``n > window`` (a view)."""
        if window >= self.n:
            if window >= len(self.arr):
                grown = np.empty((max(window + 1, 2 * len(self.arr)), *self.arr.shape[1:]), self.arr.dtype)
                grown[: self.n] = self.arr[: self.n]
                self.arr = grown
            e = self.arr.shape[2]
            for w in range(self.n, window + 1):
                perm = self.arr[w - 1].copy()
                for li in range(perm.shape[0]):
                    p = self.hotness[li] if self.hotness[li].sum() > 0 else None
                    # Pool experts to move, weighted by how often they are routed; partners uniform.
                    src = self.rng.choice(e, size=self.n_swap, replace=True, p=p)
                    dst = self.rng.integers(0, e, size=self.n_swap)
                    for a, b in zip(src.tolist(), dst.tolist(), strict=True):
                        perm[li, a], perm[li, b] = perm[li, b], perm[li, a]
                self.arr[w] = perm
            self.n = window + 1
        return self.arr[: self.n]


class _PoolCounts:
    """What :meth:`SyntheticRoutes.counts_many` counts with, built once per pool: each pool row's
    labels offset by layer (``pool_flat`` ``[P, L x K]``; a skipped slot in the last bin, ``L x E``)
    and the counts of the rows before each block of ``BLOCK`` rows in the order the hash visits them
    (``[blocks + 1, L x E + 1]``, built on first use; runs are gathered whole when the stride is not
    coprime to ``P`` or the table would be large)."""

    MAX_TABLE_BYTES = 256 * 2**20
    BLOCK = 16
    """Rows per block of the table: a run counts its whole blocks from the table and gathers its ends."""

    def __init__(self, pool_ids: np.ndarray, n_experts: int) -> None:
        p, n_layers, k = pool_ids.shape
        self.n_pool, self.width = p, n_layers * n_experts + 1
        offsets = (np.arange(n_layers, dtype=np.int64) * n_experts)[None, :, None]
        flat = np.add(pool_ids, offsets, dtype=np.int64)
        if (pool_ids < 0).any():
            flat[pool_ids < 0] = self.width - 1
        self.pool_flat = flat.reshape(p, n_layers * k)
        self.stride = _HASH_MUL % p
        self.n_blocks = -(-p // self.BLOCK)
        usable = math.gcd(self.stride, p) == 1 and (self.n_blocks + 1) * self.width * 8 <= self.MAX_TABLE_BYTES
        # From this many tokens a run is cheaper as table rows ([L x E]) and its ends than gathered ([n, L x K]).
        self.long_tokens = max(2 * self.BLOCK, 2 * n_experts // max(k, 1)) if usable else np.iinfo(np.int64).max
        self.inverse = pow(self.stride, -1, p) if usable else 0
        self._prefix: np.ndarray | None = None

    def cyclic_index(self, pos: int, salt: int) -> int:
        """Where token ``pos`` of a request with ``salt`` sits in the hash's order of the pool rows:
        its row is ``order[(pos + salt / stride) mod P]`` with ``order[j] = j x stride mod P``."""
        return (pos + (salt % self.n_pool) * self.inverse) % self.n_pool

    @property
    def prefix(self) -> np.ndarray:
        """``[blocks + 1, width]`` int64: at ``b`` the counts of the rows at cyclic indices below ``b x BLOCK``."""
        if self._prefix is None:
            p = self.n_pool
            order = (np.arange(p, dtype=np.int64) * self.stride) % p
            block = (np.arange(p, dtype=np.int64) // self.BLOCK)[:, None] * self.width
            per_block = np.bincount((block + self.pool_flat[order]).reshape(-1), minlength=self.n_blocks * self.width)
            table = np.zeros((self.n_blocks + 1, self.width), np.int64)
            np.cumsum(per_block.reshape(self.n_blocks, self.width), axis=0, out=table[1:])
            self._prefix = table
        return self._prefix

    def run_counts(self, j: int, n: int) -> tuple[np.ndarray | None, list[tuple[int, int]]]:
        """Counts ``[width]`` of what the table counts of ``n`` consecutive tokens from cyclic index ``j``
        (wrapping around the pool; None if nothing), and the ``(offset, length)`` pieces of the run it
        leaves to gather (its ends, inside blocks)."""
        table, p, size = self.prefix, self.n_pool, self.BLOCK
        laps, rest = divmod(n, p)
        out = laps * table[-1] if laps else None  # every row once per lap
        left: list[tuple[int, int]] = []
        pieces = [(j, rest, 0)] if j + rest <= p else [(j, p - j, 0), (0, j + rest - p, p - j)]
        for start, length, off in pieces:
            stop = start + length
            lo = -(-start // size)
            hi = self.n_blocks if stop == p else stop // size
            lo_at, hi_at = min(lo * size, p), min(hi * size, p)
            if lo_at >= hi_at:
                left.append((off, length))
                continue
            got = table[hi] - table[lo]
            out = got if out is None else out + got
            if lo_at > start:
                left.append((off, lo_at - start))
            if stop > hi_at:
                left.append((off + hi_at - start, stop - hi_at))
        return out, [piece for piece in left if piece[1] > 0]


class _PrunedPool(NamedTuple):
    """The pool as :func:`~engine.moe.policy.routing.prune_routes` prunes it for one (top-k override,
    minimum gate weight): a pruning decides by a row's gate weights alone, so every token taking a pool
    row keeps that row's slots. ``keep`` ``[P, L, K]`` bool, ``counter`` over the pruned ids."""

    keep: np.ndarray
    counter: _PoolCounts


def tokens_of(prompt_len: int, max_new_tokens: int) -> int:
    """Tokens a request routes: its prompt, then every generated token but the last, fed back."""
    return prompt_len + max(max_new_tokens - 1, 0)

