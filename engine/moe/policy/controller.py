"""The residency controller: every expert decision of a run, one MoE layer of one step at a time.

It holds the state the decisions depend on (which experts are resident and in which precision, the
expert cache, replica counts, the dynamic re-planner's hotness, the recent-load window, next-layer
co-occurrence) and nothing else: no weights, no device. Per step and MoE layer,
:meth:`ResidencyController.plan_layer` takes the layer's routed expert ids and returns the
:class:`~engine.moe.policy.plan.LayerDecision` (cache accessed once per micro-batch with all its
experts pinned together, then :func:`~engine.moe.policy.plan.plan_runs`); after the step,
:meth:`ResidencyController.end_step` returns the :class:`~engine.moe.policy.plan.StepMoves`
(dynamic promotions and demotions, replica counts). A decision takes effect from the next plan on:
the mechanism makes the fast tier match (waiting for a copy a plan needs), so the plans, and the
statistics counted from them, are the same whichever backend executes them.

Pure and deterministic (numpy and the standard library).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from engine.moe.policy.batching import step_slices
from engine.moe.policy.execution import CostModel
from engine.moe.policy.plan import (
    WHERE,
    DecisionLog,
    LayerDecision,
    PartPlan,
    ReplicaChange,
    RunArrays,
    StepMoves,
    TierStats,
    counts_by_layer,
    counts_of,
    moves_bytes,
    plan_run_arrays,
    plan_where,
    tier_bytes,
)
from engine.moe.policy.replication import plan_replicas
from engine.moe.policy.residency import (
    TIER_CODES,
    DynamicResidency,
    ExpertCache,
    ResidencyPlan,
    StepAccess,
    layer_budgets,
    plan_static,
)

_FETCH = WHERE.index("fetch")
_HOST_WHERE = WHERE.index("host")

SWAP_SHARE_DEFAULT = 8
"""With ``dynamic_max_swaps == 0``, a re-plan makes at most one exchange per this many experts of a
layer (and at least one): ``max(1, n_experts // 8)``. A policy parameter, documented here once."""


@dataclass(frozen=True)
class PlanSettings:
    """What the controller needs from the config and the model, as plain values.

    ``residency``: ``all`` | ``static`` | ``dynamic`` | ``cache``. Bytes are exact bytes of one
    expert: ``bytes_hi`` / ``bytes_lo`` of its resident copies (``bytes_lo`` None without a
    low-precision copy), ``bytes_host`` of its host copy (what a fetch moves, at ``bytes_hi`` on
    arrival). ``resident_as_loaded``: the resident copies are the loaded weights themselves (every
    expert resident in the loaded precision), so nothing is copied at start.
    """

    n_layers: int
    n_experts: int
    residency: str = "all"
    budget_bytes: int = 0
    budget_split: str = "uniform"
    budget_vector: tuple[float, ...] | None = None
    bytes_hi: int = 1
    bytes_lo: int | None = None
    bytes_host: int = 1
    resident_as_loaded: bool = True
    missing: str = "host"
    batching: str = "coalesced"
    micro_batch_tokens: int = 1
    dynamic_half_life_tokens: float = 2048.0
    dynamic_replan_tokens: int = 512
    dynamic_hysteresis: float = 0.2
    dynamic_max_swaps: int = 0
    cache_policy: str = "lru"
    prefetch_experts: int = 0
    max_replicas: int = 0
    replica_threshold: float = 2.0
    replica_window_tokens: int = 1024

    @property
    def trivial(self) -> bool:
        """Every routed expert runs on its resident copy in one product per step: nothing to decide."""
        return self.residency == "all" and self.max_replicas == 0 and self.batching == "coalesced"

    @property
    def max_swaps_per_replan(self) -> int:
        return self.dynamic_max_swaps or max(1, self.n_experts // SWAP_SHARE_DEFAULT)


class _LayerDecisions(Sequence[LayerDecision]):
    """Every MoE layer's decision of one step, each built when read (``_layer``); ``counts`` ``[L, E]``."""

    counts: np.ndarray

    def __len__(self) -> int:
        return int(self.counts.shape[0])

    @overload
    def __getitem__(self, i: int) -> LayerDecision: ...

    @overload
    def __getitem__(self, i: slice) -> list[LayerDecision]: ...

    def __getitem__(self, i: int | slice) -> LayerDecision | list[LayerDecision]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        li = i % len(self)
        return self._layer(li)

    def _layer(self, li: int) -> LayerDecision:
        raise NotImplementedError


class TrivialStep(_LayerDecisions):
    """The trivial decisions of every MoE layer of one step (every routed expert resident, one
    micro-batch), each built when read: ``counts`` ``[L, E]`` over ``n_tokens`` tokens."""

    trivial = True

    def __init__(self, counts: np.ndarray, n_tokens: int) -> None:
        self.counts = counts
        self.n_tokens = n_tokens

    def _layer(self, li: int) -> LayerDecision:
        return LayerDecision(li, self.counts[li], self.n_tokens)


class StepPlan(_LayerDecisions):
    """The decisions of every MoE layer of one step planned at once (:meth:`ResidencyController.plan_step`):
    ``where`` ``[L, E]`` (an index into :data:`WHERE` per routed expert, -1 where not routed), ``splits``
    per layer of replicated runs; each :class:`LayerDecision` is built when read."""

    trivial = False

    def __init__(self, counts: np.ndarray, where: np.ndarray, n_tokens: int,
                 splits: dict[int, tuple[tuple[int, tuple[int, ...]], ...]], cache: StepAccess | None = None,
                 runs_by_where: tuple[int, ...] | None = None) -> None:
        self.counts, self.where, self.n_tokens, self.splits = counts, where, n_tokens, splits
        self.runs_by_where = runs_by_where if runs_by_where is not None else \
            tuple(np.bincount(where[where >= 0], minlength=len(WHERE)).tolist())
        """Runs per place of :data:`WHERE` over every layer of the step."""
        self.cache = cache
        """Cache residency: every layer's access of the step (None without a cache)."""
        self.n_admitted = cache.admitted.sum(1) if cache is not None else None
        """Experts each layer's cache took in ``[L]`` (None without a cache)."""

    def _layer(self, li: int) -> LayerDecision:
        routed = np.flatnonzero(self.where[li] >= 0)
        arrays = RunArrays(routed.astype(np.int64), self.counts[li, routed].astype(np.int64),
                           self.where[li, routed].astype(np.int8), self.splits.get(li, ()))
        access, admitted = self.cache.layer(li) if self.cache is not None else (None, ())
        return LayerDecision(li, self.counts[li], self.n_tokens,
                             (PartPlan(0, self.n_tokens, None, access, admitted, arrays),))


class ResidencyController:
    """Residency state and the plans of every MoE layer (see the module docstring).

    ``hotness`` ``[L, E]`` (shares per layer) seeds static and dynamic residency and the
    proportional budget split; without it experts are equally hot. ``cost`` is needed when
    ``missing == "auto"`` and an expert is missing. ``log``, when given, receives every decision.
    """

    def __init__(self, settings: PlanSettings, hotness: np.ndarray | None = None, cost: CostModel | None = None,
                 log: DecisionLog | None = None) -> None:
        s = self.settings = settings
        self.cost = cost
        self.log = log
        self.stats = TierStats()
        n_layers, n_experts = s.n_layers, s.n_experts
        self.dynamic: DynamicResidency | None = None
        self.cache: ExpertCache | None = None
        if s.residency == "all":
            self.plan = ResidencyPlan(n_experts, s.bytes_hi, None, tuple([s.bytes_hi * n_experts] * n_layers),
                                      tuple(tuple(range(n_experts)) for _ in range(n_layers)),
                                      tuple(() for _ in range(n_layers)))
        else:
            hot = np.full((n_layers, n_experts), 1.0 / n_experts) if hotness is None else np.asarray(hotness)
            budgets = layer_budgets(s.budget_bytes, s.budget_split, n_layers, load=hot.sum(axis=1),
                                    vector=s.budget_vector)
            if s.residency == "cache":
                self.cache = ExpertCache.from_budgets(n_experts, budgets, s.bytes_hi, policy=s.cache_policy)
                self.plan = ResidencyPlan(n_experts, s.bytes_hi, None, tuple(budgets.tolist()),
                                          tuple(() for _ in range(n_layers)), tuple(() for _ in range(n_layers)))
            elif s.residency == "dynamic":
                self.dynamic = DynamicResidency.from_hotness(
                    hot, budgets, s.bytes_hi, s.bytes_lo, half_life_tokens=s.dynamic_half_life_tokens,
                    replan_interval_tokens=s.dynamic_replan_tokens, hysteresis=s.dynamic_hysteresis,
                    max_swaps_per_replan=s.max_swaps_per_replan)
                self.plan = self.dynamic.plan
            elif s.residency == "static":
                self.plan = plan_static(hot, budgets, s.bytes_hi, s.bytes_lo)
            else:
                raise ValueError(f"residency must be all, static, dynamic or cache, got {s.residency!r}")
        self.tiers = self.plan.tier_codes().astype(np.int8)  # writable: the cache changes it
        self.replicas = np.zeros((n_layers, n_experts), np.int64)
        self._recent: list[np.ndarray] = []
        self._recent_tokens = 0
        self._step_ids: dict[int, np.ndarray] = {}
        self._bytes_of = {"hi": s.bytes_hi, "lo": s.bytes_lo or 0, "host": 0}
        if not s.resident_as_loaded:
            self.stats.bytes_to_fast += int(self.plan.bytes_used().sum())
        if log is not None:
            log.initial(self.plan.hi, self.plan.lo)

    # ------------------------------------------------------------------ per layer
    def plan_layer(self, layer: int, ids: np.ndarray, counts: np.ndarray | None = None) -> LayerDecision:
        """The decision of MoE layer ``layer`` (0-based among MoE layers) for a step whose routed
        expert ids are ``ids`` ``[T, K]`` (-1 = skipped slot); ``counts``: their tokens per expert,
        when already counted."""
        s = self.settings
        t = int(ids.shape[0])
        if counts is None:
            counts = counts_of(ids, s.n_experts)
        if s.trivial:
            self.stats.expert_calls_fast_hi += int(np.count_nonzero(counts))
            decision = LayerDecision(layer, counts, t)
        else:
            parts = tuple(self._plan_part(layer, ids[sl], sl.start, sl.stop, counts if t == sl.stop - sl.start
                                          else None) for sl in step_slices(t, s.batching, s.micro_batch_tokens))
            prefetch: tuple[int, ...] = ()
            evicted: tuple[int, ...] = ()
            if self.cache is not None and s.prefetch_experts > 0:
                prefetch, evicted = self._prefetch_next(layer, ids, counts)
            decision = LayerDecision(layer, counts, t, parts, prefetch, evicted)
        if self.log is not None:
            self.log.layer(decision)
        return decision

    def reads_ids(self, n_tokens: int) -> bool:
        """Whether :meth:`plan_step` of a step of ``n_tokens`` tokens reads the routed ids themselves
        (micro-batches, cache prefetch), not only their counts per expert."""
        s = self.settings
        if s.trivial:
            return False
        one_part = len(step_slices(n_tokens, s.batching, s.micro_batch_tokens)) == 1
        return not (one_part and (self.cache is None or s.prefetch_experts == 0))

    def plan_step(self, ids: np.ndarray | None, counts: np.ndarray | None = None,
                  n_tokens: int | None = None) -> tuple[Sequence[LayerDecision], np.ndarray]:
        """The decisions of every MoE layer of a step whose routed ids are ``ids`` ``[T, L, K]``, in
        layer order (what :meth:`plan_layer` decides for each), and the step's routed counts ``[L, E]``.
        Trivial plans come as a :class:`TrivialStep` that builds each decision when read. ``counts``:
        the ids' counts when already counted; with them ``ids`` may be None (give ``n_tokens``) where
        :meth:`reads_ids` says the plan reads only the counts."""
        t = int(ids.shape[0]) if ids is not None else n_tokens
        if t is None or (ids is None and (counts is None or self.reads_ids(t))):
            raise ValueError("plan_step needs the routed ids (or their counts and n_tokens where reads_ids is False)")
        if counts is None:
            assert ids is not None
            counts = counts_by_layer(ids, self.settings.n_experts)
        if self.settings.trivial:
            self.stats.expert_calls_fast_hi += int(np.count_nonzero(counts))
            decisions = TrivialStep(counts, t)
            if self.log is not None:
                for d in decisions:
                    self.log.layer(d)
            return decisions, counts
        if not self.reads_ids(t):
            access = self._access_all_layers(counts) if self.cache is not None else None
            decisions = self._plan_all_layers(counts, t, access)
            if self.log is not None:
                for d in decisions:
                    self.log.layer(d)
            return decisions, counts
        assert ids is not None
        return [self.plan_layer(li, ids[:, li, :], counts[li]) for li in range(counts.shape[0])], counts

    def _access_all_layers(self, counts: np.ndarray) -> StepAccess:
        """The cache access of every layer of a step (one micro-batch, no prefetch: nothing links one
        layer's cache to the next within a step), as :meth:`_plan_part` makes it layer by layer."""
        cache = self.cache
        assert cache is not None
        s, st = self.settings, self.stats
        hits, misses, evictions = cache.hits, cache.misses, cache.evictions
        acc = cache.access_step(counts > 0)
        self.tiers[acc.evicted] = TIER_CODES["host"]
        self.tiers[acc.admitted] = TIER_CODES["hi"]
        n_ev, n_adm = cache.evictions - evictions, int(acc.admitted.sum())
        st.cache_hits += cache.hits - hits
        st.cache_misses += cache.misses - misses
        st.cache_evictions += n_ev
        st.bytes_evicted += n_ev * s.bytes_hi
        st.bytes_to_fast += n_adm * s.bytes_hi
        return acc

    def _plan_all_layers(self, counts: np.ndarray, t: int, access: StepAccess | None = None) -> StepPlan:
        """:meth:`plan_layer` of every layer at once where nothing changes between layers within a step
        (one micro-batch; a cache without prefetch): the same runs as :func:`plan_run_arrays` per
        layer, elementwise."""
        s = self.settings
        where = plan_where(counts, self.tiers, s.missing, self.cost, s.bytes_host)  # [L, E], -1 = not routed
        n_by = np.bincount((where + 1).ravel(), minlength=len(WHERE) + 1)[1:].tolist()  # -1 (not routed) dropped
        st = self.stats
        st.expert_calls_fast_hi += n_by[0]
        st.expert_calls_fast_lo += n_by[1]
        st.expert_calls_host += n_by[2]
        st.expert_calls_fetched += n_by[3]
        st.bytes_to_fast += s.bytes_hi * n_by[3]
        splits: dict[int, tuple[tuple[int, tuple[int, ...]], ...]] = {}
        replicated = (where >= 0) & (where < _HOST_WHERE) & (self.replicas > 0) if s.max_replicas > 0 else None
        if replicated is not None and replicated.any():  # replicas exist only with max_replicas > 0
            layers, experts = np.nonzero(replicated)
            copies = self.replicas[replicated] + 1
            per_copy, extra = np.divmod(counts[replicated], copies)  # split_tokens: near-equal, extras first
            by_layer: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
            for li, e, c, q, x in zip(layers.tolist(), experts.tolist(), copies.tolist(), per_copy.tolist(),
                                      extra.tolist(), strict=True):
                by_layer.setdefault(li, []).append((e, (q + 1,) * x + (q,) * (c - x)))
            splits = {li: tuple(runs) for li, runs in by_layer.items()}
            st.replica_calls += int((copies - 1).sum())
        return StepPlan(counts, where, t, splits, access, tuple(n_by))

    def _plan_part(self, layer: int, ids: np.ndarray, start: int, stop: int,
                   counts: np.ndarray | None) -> PartPlan:
        s = self.settings
        if counts is None:
            counts = counts_of(ids, s.n_experts)
        access = None
        admitted: tuple[int, ...] = ()
        if self.cache is not None:
            # One access per micro-batch: its experts are needed together, so none evicts another.
            access = self.cache.access(layer, np.flatnonzero(counts).tolist())
            cached = set(self.cache.cached(layer))
            admitted = tuple(e for e in access.misses if e in cached)
            for e in access.evictions:
                self.tiers[layer, e] = TIER_CODES["host"]
            self.tiers[layer, list(admitted)] = TIER_CODES["hi"]
            st = self.stats
            st.cache_hits += len(access.hits)
            st.cache_misses += len(access.misses)
            st.cache_evictions += len(access.evictions)
            st.bytes_evicted += len(access.evictions) * s.bytes_hi
            st.bytes_to_fast += len(admitted) * s.bytes_hi
        arrays = plan_run_arrays(counts, self.tiers[layer], self.replicas[layer], s.missing, self.cost, s.bytes_host)
        self.stats.count_arrays(arrays)
        self.stats.bytes_to_fast += s.bytes_hi * int(np.count_nonzero(arrays.where == _FETCH))
        return PartPlan(start, stop, None, access, admitted, arrays)

    def _prefetch_next(self, layer: int, ids: np.ndarray, counts: np.ndarray) -> tuple[tuple[int, ...],
                                                                                     tuple[int, ...]]:
        """Cache residency: learn layer-to-layer co-occurrence and pick the next layer's likely experts."""
        cache = self.cache
        assert cache is not None
        s = self.settings
        self._step_ids[layer] = np.asarray(ids)
        if layer == s.n_layers - 1:
            if len(self._step_ids) == s.n_layers:
                cache.observe(np.stack([self._step_ids[i] for i in range(s.n_layers)], axis=1))
            self._step_ids = {}
            return (), ()
        current = {int(e): int(counts[e]) for e in np.flatnonzero(counts)}
        want = cache.prefetch_candidates(layer + 1, current, s.prefetch_experts)
        if not want:
            return (), ()
        evicted = cache.prefetch(layer + 1, want)
        loaded = tuple(e for e in want if e in set(cache.cached(layer + 1)))
        nxt = self.tiers[layer + 1]
        nxt[list(evicted)] = TIER_CODES["host"]
        nxt[list(loaded)] = TIER_CODES["hi"]
        st = self.stats
        st.prefetched += len(want)
        st.cache_evictions += len(evicted)
        st.bytes_evicted += len(evicted) * s.bytes_hi
        st.bytes_to_fast += len(loaded) * s.bytes_hi
        st.swaps += len(loaded)
        return loaded, tuple(evicted)

    # ------------------------------------------------------------------ per step
    @property
    def wants_step_counts(self) -> bool:
        """Whether :meth:`end_step` reads the step's routed counts (dynamic residency, replicas)."""
        return self.dynamic is not None or self.settings.max_replicas > 0

    def end_step(self, counts: np.ndarray | None, tokens: int) -> StepMoves:
        """After a step: routed tokens per expert ``[L, E]`` over ``tokens`` tokens feed dynamic
        residency and replica planning (``counts`` may be None unless :attr:`wants_step_counts`);
        returns what changes from the next step on."""
        s = self.settings
        demotions: tuple = ()
        promotions: tuple = ()
        replanned = False
        if self.wants_step_counts and counts is None:
            raise ValueError("end_step needs the step's routed counts (dynamic residency or replicas)")
        if self.dynamic is not None:
            res = self.dynamic.update(counts, tokens)
            if res is not None:
                replanned = True
                self.stats.replans += 1
                demotions = tuple(m for layer_moves in res.demotions for m in layer_moves)
                promotions = tuple(m for layer_moves in res.promotions for m in layer_moves)
                # A demotion to lo builds a lo copy: a copy to the fast tier like a promotion.
                to_fast = [m for m in demotions if m.dst != "host"] + list(promotions)
                up, down = moves_bytes([*demotions, *promotions], self._bytes_of)
                self.stats.bytes_to_fast += up
                self.stats.bytes_evicted += down
                self.stats.swaps += len(to_fast)
                self.plan = res.plan
                self.tiers = res.plan.tier_codes().astype(np.int8)
        changes: list[ReplicaChange] = []
        if s.max_replicas > 0 and counts is not None:
            self._recent.append(np.asarray(counts))
            self._recent_tokens += int(tokens)
            if self._recent_tokens >= s.replica_window_tokens:
                changes = self._replan_replicas(np.sum(self._recent, axis=0))
                self._recent, self._recent_tokens = [], 0
        moves = StepMoves(demotions, promotions, tuple(changes), replanned)
        if self.log is not None:
            self.log.end_step(moves)
        return moves

    def _replan_replicas(self, recent: np.ndarray) -> list[ReplicaChange]:
        s = self.settings
        if s.residency == "all":
            spare = np.full(s.n_layers, s.budget_bytes)
        else:
            spare = np.maximum(0, np.asarray(self.plan.budgets_bytes) - self.plan.bytes_used())
        wanted = plan_replicas(recent, s.replica_threshold, s.max_replicas, spare, s.bytes_hi)
        new = np.zeros_like(self.replicas)
        for layer, per_expert in wanted.items():
            for e, n in per_expert.items():
                new[layer, e] = n
        changed = new != self.replicas
        # In layer then expert order, as the mechanism applies them.
        changes = [ReplicaChange(layer, e, n) for layer, e, n in zip(*(x.tolist() for x in np.nonzero(changed)),
                                                                     new[changed].tolist(), strict=True)]
        self.stats.bytes_to_fast += int(new[changed].sum()) * s.bytes_hi
        self.replicas[...] = new
        return changes

    # ------------------------------------------------------------------ state
    def resident_bytes(self) -> int:
        """Fast-tier bytes the state holds: resident copies and replicas (the loaded weights when
        they are the resident copies)."""
        s = self.settings
        n_hi, n_lo = int(np.count_nonzero(self.tiers == 2)), int(np.count_nonzero(self.tiers == 1))
        total = n_hi * tier_bytes(2, s.bytes_hi, s.bytes_lo) + n_lo * tier_bytes(1, s.bytes_hi, s.bytes_lo)
        return int(total + self.replicas.sum() * s.bytes_hi)

    def expert_table(self, hi: str, lo: str | None, host: str) -> dict[tuple[int, int], tuple[bool, str, int]]:
        """(MoE layer index, expert) -> (resident, precision it runs in, replicas), given the
        precision names of the tiers."""
        names = {0: host, 1: lo or host, 2: hi}
        return {(layer, e): (bool(code), names[code], int(rep))
                for layer, (codes, reps) in enumerate(zip(self.tiers.tolist(), self.replicas.tolist(), strict=True))
                for e, (code, rep) in enumerate(zip(codes, reps, strict=True))}
