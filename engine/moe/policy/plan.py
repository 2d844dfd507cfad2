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

from engine.moe.policy.execution import CostModel, Mode, plan_layer
from engine.moe.policy.replication import split_tokens
from engine.moe.policy.residency import TIER_NAMES, CacheAccess, Move

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


@dataclass(frozen=True)
class PartPlan:
    """One micro-batch of a layer: token rows ``[start, stop)`` of the step, the runs in expert order,
    and the cache access (``None`` without cache residency); ``admitted`` are the misses the cache took in."""

    start: int
    stop: int
    runs: tuple[ExpertRun, ...]
    cache: CacheAccess | None = None
    admitted: tuple[int, ...] = ()

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
    def parts(self) -> tuple[PartPlan, ...]:
        if self._parts is None:
            runs = tuple(ExpertRun(int(e), int(self.counts[e]), "hi") for e in np.flatnonzero(self.counts))
            object.__setattr__(self, "_parts", (PartPlan(0, self.n_tokens, runs),))
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
    fetched, as :func:`~engine.moe.policy.execution.plan_layer` decides from ``mode`` and ``cost``
    for an expert of ``host_bytes`` bytes. Runs are in expert order.
    """
    routed = {int(e): int(counts[e]) for e in np.flatnonzero(np.asarray(counts))}
    tier = np.asarray(tiers)
    resident = [e for e in routed if tier[e] > 0]
    placement = plan_layer(routed, resident, mode, cost, host_bytes) if len(resident) < len(routed) else {}
    out = []
    for e, n in routed.items():
        code = int(tier[e])
        if code > 0:
            r = int(replicas[e])
            out.append(ExpertRun(e, n, TIER_NAMES[code], tuple(split_tokens(n, r + 1)) if r else ()))
        else:
            out.append(ExpertRun(e, n, placement[e]))
    return tuple(out)


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
    last: dict[int, np.ndarray] = field(default_factory=dict)  # the last step's counts per layer

    def add(self, layer: int, counts: np.ndarray | Sequence[int]) -> None:
        """Record one step of one layer: ``counts[e]`` tokens routed to expert ``e``."""
        c = np.asarray(counts, dtype=np.int64)
        self.layer_calls += 1
        self.distinct_experts += int(np.count_nonzero(c))
        self.last[layer] = c
        if layer in self.counts:
            self.counts[layer] = self.counts[layer] + c
        else:
            self.counts[layer] = c.copy()

    def step_counts(self, layers: Sequence[int]) -> np.ndarray:
        """Routed tokens per expert in the last step, ``[len(layers), E]``."""
        return np.stack([self.last[layer] for layer in layers])

    def mean_distinct(self) -> float:
        """Mean number of distinct experts one MoE layer ran per step."""
        return self.distinct_experts / self.layer_calls if self.layer_calls else 0.0

    def reset(self) -> None:
        self.counts.clear()
        self.last.clear()
        self.layer_calls = self.distinct_experts = 0


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
