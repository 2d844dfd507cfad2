"""Plans: what one MoE layer does with one step's tokens, as data, and the statistics read from them.

A :class:`LayerDecision` says, for one step and one MoE layer, per micro-batch (:class:`PartPlan`):
which experts run on their resident copy (``"hi"`` or ``"lo"`` precision), which on the host, which
are fetched to the fast tier first, how a replicated expert's tokens are split across its copies,
and what the expert cache did (hits, misses, admissions, evictions, next-layer prefetches).
:class:`StepMoves` are the tier changes decided after a step (promotions, demotions, replica
counts). The live engine executes these; a backend without tensors prices them; both count
statistics from them with :class:`TierStats`, and both write them with :class:`DecisionLog`.

Pure and deterministic (numpy and the standard library).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np

from engine.moe.policy.execution import CostModel, Mode
from engine.moe.policy.replication import split_tokens
from engine.moe.policy.residency import CacheAccess, Move

Where = Literal["hi", "lo", "host", "fetch"]
WHERE: tuple[Where, ...] = ("hi", "lo", "host", "fetch")
"""Where an expert runs: its resident high- or low-precision copy, its host copy, or a fetched copy."""


class ExpertRun(NamedTuple):
    """One expert with tokens in one micro-batch: ``split`` holds the tokens per copy when it is
    replicated (its own copy first, then each replica), else ``()``."""

    expert: int
    tokens: int
    where: Where
    split: tuple[int, ...] = ()


class RunArrays(NamedTuple):
    """The runs of one micro-batch as arrays, in expert order: ``experts`` and ``tokens`` int64 ``[R]``,
    ``where`` int8 ``[R]`` (an index into :data:`WHERE`), and ``splits``: ``(expert, tokens per copy)``
    of each replicated run. What backends without tensors read; :meth:`runs` is the same as tuples."""

    experts: np.ndarray
    tokens: np.ndarray
    where: np.ndarray
    splits: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def runs(self) -> tuple[ExpertRun, ...]:
        split = dict(self.splits)
        return tuple(ExpertRun(e, n, WHERE[w], split.get(e, ()))
                     for e, n, w in zip(self.experts.tolist(), self.tokens.tolist(), self.where.tolist(), strict=True))

    @classmethod
    def of_runs(cls, runs: Sequence[ExpertRun]) -> RunArrays:
        return cls(np.array([r.expert for r in runs], np.int64), np.array([r.tokens for r in runs], np.int64),
                   np.array([WHERE.index(r.where) for r in runs], np.int8),
                   tuple((r.expert, tuple(r.split)) for r in runs if r.split))


@dataclass(frozen=True)
class PartPlan:
    """One micro-batch of a layer: token rows ``[start, stop)`` of the step, the runs in expert order
    (given, or built on first use from ``arrays``), and the cache access (``None`` without cache
    residency); ``admitted`` are the misses the cache took in."""

    start: int
    stop: int
    _runs: tuple[ExpertRun, ...] | None = None
    cache: CacheAccess | None = None
    admitted: tuple[int, ...] = ()
    _arrays: RunArrays | None = None

    @property
    def runs(self) -> tuple[ExpertRun, ...]:
        if self._runs is None:
            assert self._arrays is not None
            object.__setattr__(self, "_runs", self._arrays.runs())
        return self._runs  # type: ignore[return-value]

    @property
    def arrays(self) -> RunArrays:
        if self._arrays is None:
            object.__setattr__(self, "_arrays", RunArrays.of_runs(self.runs))
        return self._arrays  # type: ignore[return-value]

    def compact(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rows": [self.start, self.stop]}
        for where in WHERE:
            got = [[r.expert, r.tokens] for r in self.runs if r.where == where]
            if got:
                out[where] = got
        split = [[r.expert, list(r.split)] for r in self.runs if r.split]
        if split:
            out["split"] = split
        if self.cache is not None:
            for key, ids in (("hit", self.cache.hits), ("miss", self.cache.misses), ("admit", self.admitted),
                             ("evict", self.cache.evictions)):
                if ids:
                    out[key] = list(ids)
        return out


@dataclass(frozen=True)
class LayerDecision:
    """Everything one MoE layer (index ``layer`` among the MoE layers) decided for one step.

    ``counts[e]`` are the step's tokens routed to expert ``e``. ``prefetch`` are experts of the next
    MoE layer copied up after this one (cache residency), ``prefetch_evicted`` what that evicted there.
    ``parts`` is built on first use for trivial plans (every routed expert resident, one micro-batch),
    so the plain engine pays for a plan only when something reads it.
    """

    layer: int
    counts: np.ndarray
    n_tokens: int
    _parts: tuple[PartPlan, ...] | None = None
    prefetch: tuple[int, ...] = ()
    prefetch_evicted: tuple[int, ...] = ()

    @property
    def trivial(self) -> bool:
        """Every routed expert resident in one micro-batch (the parts are built only when read)."""
        return self._parts is None

    @property
    def parts(self) -> tuple[PartPlan, ...]:
        if self._parts is None:
            routed = np.flatnonzero(self.counts)
            arrays = RunArrays(routed, np.asarray(self.counts)[routed].astype(np.int64),
                               np.zeros(len(routed), np.int8))
            object.__setattr__(self, "_parts", (PartPlan(0, self.n_tokens, _arrays=arrays),))
        return self._parts  # type: ignore[return-value]

    def compact(self) -> dict[str, Any]:
        """The decision as plain JSON types (one line of the decision log, without the step)."""
        out: dict[str, Any] = {"layer": self.layer, "parts": [p.compact() for p in self.parts]}
        if self.prefetch:
            out["prefetch"] = list(self.prefetch)
        if self.prefetch_evicted:
            out["prefetch_evict"] = list(self.prefetch_evicted)
        return out


class ReplicaChange(NamedTuple):
    """Expert ``expert`` of MoE layer ``layer`` now has ``replicas`` extra copies (0 drops them)."""

    layer: int
    expert: int
    replicas: int


@dataclass(frozen=True)
class StepMoves:
    """Tier changes decided after a step, in the order the mechanism applies them: demotions, then
    promotions (dynamic residency; each a :class:`Move` between tiers), then replica counts.
    ``replanned`` says a dynamic re-plan ran (it may move nothing)."""

    demotions: tuple[Move, ...] = ()
    promotions: tuple[Move, ...] = ()
    replicas: tuple[ReplicaChange, ...] = ()
    replanned: bool = False

    @property
    def empty(self) -> bool:
        return not (self.demotions or self.promotions or self.replicas or self.replanned)

    def compact(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.replanned:
            out["replan"] = True
        if self.demotions:
            out["demote"] = [[m.layer, m.expert, m.src, m.dst] for m in self.demotions]
        if self.promotions:
            out["promote"] = [[m.layer, m.expert, m.src, m.dst] for m in self.promotions]
        if self.replicas:
            out["replicas"] = [list(r) for r in self.replicas]
        return out


def plan_runs(counts: np.ndarray | Sequence[int], tiers: np.ndarray | Sequence[int],
              replicas: np.ndarray | Sequence[int], mode: Mode, cost: CostModel | None,
              host_bytes: int) -> tuple[ExpertRun, ...]:
    """Where each expert with tokens runs in one micro-batch of one layer: the placement decision.

    ``counts[e]``: tokens routed to expert ``e``; ``tiers[e]``: its tier code (0 host, 1 lo, 2 hi;
    :data:`~engine.moe.policy.residency.TIER_CODES`); ``replicas[e]``: its extra copies. A resident
    expert runs in its tier's precision, its tokens split across its copies when it has replicas
    (:func:`~engine.moe.policy.replication.split_tokens`); a missing one runs on the host or is
    fetched, as :func:`~engine.moe.policy.execution.decide` decides from ``mode`` and ``cost``
    for an expert of ``host_bytes`` bytes. Runs are in expert order. (:func:`plan_run_arrays` as tuples.)
    """
    return plan_run_arrays(counts, tiers, replicas, mode, cost, host_bytes).runs()


_CODE_TO_WHERE = np.array([WHERE.index("host"), WHERE.index("lo"), WHERE.index("hi")], np.int8)
_HOST, _FETCH = WHERE.index("host"), WHERE.index("fetch")


def plan_run_arrays(counts: np.ndarray | Sequence[int], tiers: np.ndarray | Sequence[int],
                    replicas: np.ndarray | Sequence[int], mode: Mode, cost: CostModel | None,
                    host_bytes: int) -> RunArrays:
    """:func:`plan_runs` as :class:`RunArrays`: the same decisions, made for all experts at once.

    ``auto`` compares :meth:`~CostModel.fetch_s` with :meth:`~CostModel.host_compute_s` elementwise
    with the same arithmetic as :func:`~engine.moe.policy.execution.decide` (a tie goes to the host).
    """
    c = np.asarray(counts)
    routed = np.flatnonzero(c)
    tokens = c[routed].astype(np.int64)
    code = np.asarray(tiers)[routed]
    where = _CODE_TO_WHERE[code]
    missing = code <= 0
    _place_missing(where, missing, tokens[missing], mode, cost, host_bytes)
    splits: tuple[tuple[int, tuple[int, ...]], ...] = ()
    rep = np.asarray(replicas)[routed]
    replicated = np.flatnonzero((~missing) & (rep > 0))
    if replicated.size:
        splits = tuple((int(routed[i]), tuple(split_tokens(int(tokens[i]), int(rep[i]) + 1)))
                       for i in replicated.tolist())
    return RunArrays(routed.astype(np.int64), tokens, where, splits)


def _place_missing(where: np.ndarray, missing: np.ndarray, tokens: np.ndarray, mode: Mode,
                   cost: CostModel | None, host_bytes: int) -> None:
    """Set ``where[missing]`` to host or fetch by ``mode``; ``tokens``: each missing expert's tokens.
    ``auto`` compares the two costs elementwise, with the arithmetic of ``execution.decide``."""
    if not missing.any():
        return
    if mode == "fetch":
        where[missing] = _FETCH
    elif mode == "auto":
        if cost is None:
            raise ValueError("mode 'auto' needs a calibrated cost model")
        n = tokens.astype(np.float64)
        h, d = cost._cost("host", None), cost._cost("device", None)
        host_s = h.overhead_s + host_bytes * (h.weight_s_per_byte + n * h.token_s_per_byte)
        fetch_s = cost.transfer_s(host_bytes) + (d.overhead_s + host_bytes * (d.weight_s_per_byte
                                                                              + n * d.token_s_per_byte))
        where[missing] = np.where(fetch_s < host_s, _FETCH, _HOST)
    elif mode != "host":
        raise ValueError(f"mode must be 'host', 'fetch' or 'auto', got {mode!r}")


def plan_where(counts: np.ndarray, tiers: np.ndarray, mode: Mode, cost: CostModel | None,
               host_bytes: int) -> np.ndarray:
    """Where each routed expert of every layer runs: int8 ``[L, E]`` indices into :data:`WHERE` (-1 where
    ``counts`` is 0), decided as :func:`plan_run_arrays` decides them layer by layer."""
    c, code = np.asarray(counts), np.asarray(tiers)
    if mode in _WHERE_BY_CODE and code.dtype == np.int8:  # host or fetch: one lookup by (routed, tier code)
        return _WHERE_BY_CODE[mode][(c > 0).view(np.int8) * np.int8(3) + code]
    where = _CODE_TO_WHERE[code]  # a new int8 array
    missing = (code <= 0) & (c > 0)
    _place_missing(where, missing, c[missing], mode, cost, host_bytes)
    where[c <= 0] = -1
    return where


# plan_where's table for modes that place a missing expert whatever its tokens: [3 x routed + tier code].
_WHERE_BY_CODE = {mode: np.array([-1, -1, -1, missing, WHERE.index("lo"), WHERE.index("hi")], np.int8)
                  for mode, missing in (("host", _HOST), ("fetch", _FETCH))}


@dataclass
class TierStats:
    """What the tiers did during a run, counted from the executed plans and moves (both backends)."""

    bytes_to_fast: int = 0
    bytes_evicted: int = 0
    expert_calls_fast_hi: int = 0
    expert_calls_fast_lo: int = 0
    expert_calls_host: int = 0
    expert_calls_fetched: int = 0
    replica_calls: int = 0
    swaps: int = 0
    replans: int = 0
    prefetched: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_evictions: int = 0

    def count_arrays(self, a: RunArrays) -> None:
        """:meth:`count_runs` of a micro-batch's :class:`RunArrays`."""
        n = np.bincount(a.where, minlength=len(WHERE)).tolist()
        self.expert_calls_fast_hi += n[0]
        self.expert_calls_fast_lo += n[1]
        self.expert_calls_host += n[2]
        self.expert_calls_fetched += n[3]
        self.replica_calls += sum(len(split) - 1 for _, split in a.splits)

    def count_runs(self, runs: Sequence[ExpertRun]) -> None:
        for r in runs:
            if r.where == "hi":
                self.expert_calls_fast_hi += 1
            elif r.where == "lo":
                self.expert_calls_fast_lo += 1
            elif r.where == "host":
                self.expert_calls_host += 1
            else:
                self.expert_calls_fetched += 1
            if r.split:
                self.replica_calls += len(r.split) - 1

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass
class MoEStats:
    """Tokens routed per expert per MoE layer (model layer index), accumulated over steps."""

    counts: dict[int, np.ndarray] = field(default_factory=dict)
    layer_calls: int = 0
    distinct_experts: int = 0  # summed over layer calls: experts that ran at least one token
    fused_steps: int = 0  # steps that ran every layer in one native call (MoEDecoder's fused decode step)
    _acc: np.ndarray | None = field(default=None, repr=False)  # add_step's [L, E]; counts' rows are views of it
    _acc_layers: tuple[int, ...] = field(default=(), repr=False)
    _last: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    _last_step: tuple[tuple[int, ...], np.ndarray] | None = field(default=None, repr=False)  # add_step's, split when read

    @property
    def last(self) -> dict[int, np.ndarray]:
        """The last step's counts per layer (split by layer when read, not at every step)."""
        self._split_last()
        return self._last

    def _split_last(self) -> None:
        if self._last_step is not None:
            self._last.update(zip(*self._last_step, strict=True))
            self._last_step = None

    def add(self, layer: int, counts: np.ndarray | Sequence[int]) -> None:
        """Record one step of one layer: ``counts[e]`` tokens routed to expert ``e``."""
        c = np.asarray(counts, dtype=np.int64)
        self._acc = None  # counts now changes layer by layer
        self.layer_calls += 1
        self.distinct_experts += int(np.count_nonzero(c))
        self.last[layer] = c  # the property: a pending add_step is split first
        if layer in self.counts:
            self.counts[layer] = self.counts[layer] + c
        else:
            self.counts[layer] = c.copy()

    def add_step(self, layers: Sequence[int], counts: np.ndarray) -> None:
        """:meth:`add` for every MoE layer of one step: ``counts`` ``[len(layers), E]``."""
        self.layer_calls += len(layers)
        self.distinct_experts += int(np.count_nonzero(counts))
        if self._acc is None or self._acc_layers != tuple(layers):
            self._split_last()  # a pending step of other layers
            acc = np.zeros(counts.shape, np.int64)
            for i, layer in enumerate(layers):
                if layer in self.counts:
                    acc[i] = self.counts[layer]
                self.counts[layer] = acc[i]
            self._acc, self._acc_layers = acc, tuple(layers)
        self._acc += counts
        self._last_step = self._acc_layers, counts

    def step_counts(self, layers: Sequence[int]) -> np.ndarray:
        """Routed tokens per expert in the last step, ``[len(layers), E]``."""
        return np.stack([self.last[layer] for layer in layers])

    def mean_distinct(self) -> float:
        """Mean number of distinct experts one MoE layer ran per step."""
        return self.distinct_experts / self.layer_calls if self.layer_calls else 0.0

    def reset(self) -> None:
        self.counts.clear()
        self._last.clear()
        self._acc = self._last_step = None
        self.layer_calls = self.distinct_experts = self.fused_steps = 0


@dataclass
class DecisionLog:
    """Every plan of a run in compact form, one entry per step and MoE layer (plus one per step with
    moves, and one ``step = -1`` entry for the initial placement): the ``--decisions`` JSON lines."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    step: int = 0

    def initial(self, hi: Sequence[Sequence[int]], lo: Sequence[Sequence[int]]) -> None:
        self.entries.append({"step": -1, "hi": [list(map(int, h)) for h in hi],
                             "lo": [list(map(int, lw)) for lw in lo]})

    def layer(self, decision: LayerDecision) -> None:
        self.entries.append({"step": self.step, **decision.compact()})

    def end_step(self, moves: StepMoves) -> None:
        if not moves.empty:
            self.entries.append({"step": self.step, "moves": moves.compact()})
        self.step += 1


def counts_by_layer(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """Tokens routed to each expert per layer of ``ids`` ``[T, L, K]`` (ids < 0 skipped): int64 ``[L, E]``
    (:func:`counts_of` of every layer, in one pass)."""
    n_layers = ids.shape[1]
    # Shift ids by one so a skipped slot (-1) lands in each layer's bin 0, which is dropped.
    stride = n_experts + 1
    # One pass: the add widens int16/int32 ids itself (an astype first is a second pass over [T, L, K]).
    flat = np.add(ids, (np.arange(n_layers, dtype=np.int64) * stride + 1)[None, :, None], dtype=np.int64)
    counts = np.bincount(flat.reshape(-1), minlength=n_layers * stride).reshape(n_layers, stride)
    return counts[:, 1:]


def counts_of(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """Tokens routed to each expert in ``ids`` (any shape; ids < 0 are skipped slots): int64 ``[E]``."""
    flat = np.asarray(ids).reshape(-1)
    return np.bincount(flat[flat >= 0], minlength=n_experts).astype(np.int64, copy=False)


def tier_bytes(code: int, bytes_hi: int, bytes_lo: int | None) -> int:
    """Bytes of an expert's fast-tier copy at tier code ``code`` (0 for the host)."""
    return bytes_hi if code == 2 else (bytes_lo or 0) if code == 1 else 0


def moves_bytes(moves: Sequence[Move], bytes_of: Mapping[str, int]) -> tuple[int, int]:
    """(bytes copied to the fast tier, bytes evicted from it) by ``moves``; ``bytes_of[tier]``."""
    up = sum(bytes_of[m.dst] for m in moves if m.dst != "host")
    down = sum(bytes_of[m.src] for m in moves if m.dst == "host")
    return up, down
