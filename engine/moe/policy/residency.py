"""Which experts live on the fast tier, in which precision: budgets, static plans, dynamic re-plans, caches.

Everything here is pure and deterministic (numpy and the standard library, no device): the live engine
executes these decisions with real tensors and the simulator executes the same decisions against a
cost model. Ties are always broken by expert id (the lower id ranks as hotter), so equal inputs give
equal plans on every machine.

Tiers of an expert at one layer: ``"hi"`` (its high-precision copy is on the fast tier), ``"lo"`` (a
low-precision copy is on the fast tier and runs there in place of the missing high-precision copy,
as in DynaExq), ``"host"`` (only the host copy exists; it is computed on the host or fetched).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np

Tier = Literal["hi", "lo", "host"]
TIER_CODES: dict[str, int] = {"host": 0, "lo": 1, "hi": 2}
"""Tier -> code of :meth:`ResidencyPlan.tier_codes`; a higher code is a faster / more precise tier."""
TIER_NAMES: tuple[Tier, Tier, Tier] = ("host", "lo", "hi")
PLAN_FORMAT = "moetune-residency-plan"
PLAN_FORMAT_VERSION = 1
NO_EXPERT = -1
"""Expert id of a slot with no expert (the router trace's convention); ignored by every table here."""


# ------------------------------------------------------------------------------------------ helpers

def _as_int(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _as_float(name: str, value: Any, minimum: float = 0.0, *, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    out = float(value)
    if not math.isfinite(out) or out < minimum or (strict and out == minimum):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {minimum}, got {value!r}")
    return out


def _nonneg_matrix(name: str, value: Any, shape: tuple[int, ...] | None = None) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if shape is not None and arr.shape != shape:
        raise ValueError(f"{name} has shape {list(arr.shape)}, expected {list(shape)}")
    if arr.size and (not np.all(np.isfinite(arr)) or arr.min() < 0):
        raise ValueError(f"{name} must be finite and >= 0")
    return arr


def rank_experts(shares: np.ndarray) -> np.ndarray:
    """Expert ids from hottest to coldest: by share descending, then by id ascending (deterministic)."""
    shares = np.asarray(shares, dtype=np.float64)
    return np.lexsort((np.arange(shares.size), -shares)).astype(np.int64)


def _strongest(ids: np.ndarray, shares: np.ndarray) -> int:
    """The hottest of ``ids`` (highest share, then lowest id)."""
    return int(ids[np.lexsort((ids, -shares[ids]))[0]])


def _weakest(ids: np.ndarray, shares: np.ndarray) -> int:
    """The coldest of ``ids`` (lowest share, then highest id): the last of them in :func:`rank_experts` order."""
    return int(ids[np.lexsort((-ids, shares[ids]))[0]])


# ------------------------------------------------------------------------------------------ budgets

def layer_budgets(total_bytes: int, split: Literal["uniform", "proportional", "vector"], n_layers: int,
                  load: np.ndarray | Sequence[float] | None = None,
                  vector: Sequence[float] | None = None) -> np.ndarray:
    """Split a fast-tier expert budget of ``total_bytes`` across ``n_layers`` MoE layers: int64 bytes ``[L]``.

    ``uniform``: equal shares. ``proportional``: shares proportional to ``load`` ``[L]`` (per-layer
    routed-token load, or any non-negative weight derived from hotness; all zeros falls back to
    uniform). ``vector``: shares proportional to ``vector`` ``[L]`` (per-layer fractions, normalised
    here, so the tuner can search them freely). Bytes are floored per layer and the leftover bytes
    go one each to the layers with the largest remainders (lowest layer first on ties), so the sum is
    exactly ``total_bytes`` (never more).
    """
    total = _as_int("total_bytes", total_bytes)
    n = _as_int("n_layers", n_layers)
    if n == 0:
        return np.zeros(0, np.int64)
    if split == "uniform":
        weights = np.ones(n)
    elif split in ("proportional", "vector"):
        given, name = (load, "load") if split == "proportional" else (vector, "vector")
        if given is None:
            raise ValueError(f"split={split!r} needs {name} (one value per layer)")
        weights = _nonneg_matrix(name, given, (n,))
        if weights.sum() == 0:
            if split == "vector":
                raise ValueError("vector must have a positive entry")
            weights = np.ones(n)
    else:
        raise ValueError(f"split must be 'uniform', 'proportional' or 'vector', got {split!r}")
    # Integer arithmetic for the exact part where possible: fractions of the total in float64, then
    # floor, then hand out the remainder by largest fractional part.
    ideal = weights / weights.sum() * total
    out = np.floor(ideal).astype(np.int64)
    out = np.minimum(out, total)
    leftover = total - int(out.sum())
    if leftover > 0:
        frac = ideal - out
        order = np.lexsort((np.arange(n), -frac))
        out[order[:leftover % n]] += 1
        out += leftover // n
    elif leftover < 0:  # float rounding pushed the floors over; take bytes back from the largest layers
        order = np.lexsort((np.arange(n), -out))
        for i in range(-leftover):
            out[order[i % n]] -= 1
    return out


# ------------------------------------------------------------------------------------------ plans

class Move(NamedTuple):
    """One expert changing tier at one layer (``src`` -> ``dst``)."""

    layer: int
    expert: int
    src: Tier
    dst: Tier


@dataclass(frozen=True)
class ResidencyPlan:
    """The fast-tier contents per MoE layer: ``hi[l]`` and ``lo[l]`` are sorted tuples of expert ids.

    ``bytes_hi`` / ``bytes_lo`` are the exact bytes of one expert in the high / low precision
    (``bytes_lo`` is None when no low-precision copy exists). The plan is checked on construction:
    ids in range, no expert in both tiers, and bytes used within ``budgets_bytes`` at every layer.
    """

    n_experts: int
    bytes_hi: int
    bytes_lo: int | None
    budgets_bytes: tuple[int, ...]
    hi: tuple[tuple[int, ...], ...]
    lo: tuple[tuple[int, ...], ...]
    _codes: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n_experts = _as_int("n_experts", self.n_experts)
        _as_int("bytes_hi", self.bytes_hi, 1)
        if self.bytes_lo is not None:
            _as_int("bytes_lo", self.bytes_lo, 1)
        budgets = tuple(_as_int(f"budgets_bytes[{i}]", b) for i, b in enumerate(self.budgets_bytes))
        hi = tuple(tuple(sorted(int(e) for e in ids)) for ids in self.hi)
        lo = tuple(tuple(sorted(int(e) for e in ids)) for ids in self.lo)
        if not len(hi) == len(lo) == len(budgets):
            raise ValueError(f"plan has {len(hi)} hi sets, {len(lo)} lo sets and {len(budgets)} budgets; "
                             "they must match (one per MoE layer)")
        codes = np.zeros((len(hi), n_experts), np.int8)
        for layer, (h, lw) in enumerate(zip(hi, lo, strict=True)):
            for name, ids in (("hi", h), ("lo", lw)):
                if len(set(ids)) != len(ids):
                    raise ValueError(f"layer {layer}: {name} lists an expert twice")
                if ids and (ids[0] < 0 or ids[-1] >= n_experts):
                    raise ValueError(f"layer {layer}: {name} ids must lie in [0, {n_experts})")
            if set(h) & set(lw):
                raise ValueError(f"layer {layer}: experts {sorted(set(h) & set(lw))} are in both hi and lo")
            if lw and self.bytes_lo is None:
                raise ValueError(f"layer {layer}: lo copies without bytes_lo")
            codes[layer, list(lw)] = TIER_CODES["lo"]
            codes[layer, list(h)] = TIER_CODES["hi"]
            used = len(h) * self.bytes_hi + len(lw) * (self.bytes_lo or 0)
            if used > budgets[layer]:
                raise ValueError(f"layer {layer}: plan uses {used} bytes, over its budget of {budgets[layer]}")
        codes.setflags(write=False)
        object.__setattr__(self, "n_experts", n_experts)
        object.__setattr__(self, "budgets_bytes", budgets)
        object.__setattr__(self, "hi", hi)
        object.__setattr__(self, "lo", lo)
        object.__setattr__(self, "_codes", codes)

    @property
    def n_layers(self) -> int:
        return len(self.hi)

    def tier(self, layer: int, expert: int) -> Tier:
        """Where ``expert`` of MoE layer ``layer`` runs from: ``"hi"``, ``"lo"`` or ``"host"``."""
        return TIER_NAMES[int(self._codes[layer, expert])]

    def tier_codes(self) -> np.ndarray:
        """Read-only int8 ``[L, E]``: 0 host, 1 lo, 2 hi (see :data:`TIER_CODES`)."""
        return self._codes

    def resident(self, layer: int) -> frozenset[int]:
        """Experts with any copy (hi or lo) on the fast tier at ``layer``."""
        return frozenset(self.hi[layer]) | frozenset(self.lo[layer])

    def bytes_used(self) -> np.ndarray:
        """Fast-tier bytes of expert weights per layer: int64 ``[L]``."""
        n_hi = np.array([len(h) for h in self.hi], np.int64)
        n_lo = np.array([len(lw) for lw in self.lo], np.int64)
        return n_hi * self.bytes_hi + n_lo * (self.bytes_lo or 0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (plain ints and lists); :meth:`from_dict` reads it back."""
        return {"format": PLAN_FORMAT, "version": PLAN_FORMAT_VERSION, "n_experts": self.n_experts,
                "bytes_hi": self.bytes_hi, "bytes_lo": self.bytes_lo,
                "budgets_bytes": list(self.budgets_bytes),
                "hi": [list(h) for h in self.hi], "lo": [list(lw) for lw in self.lo]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResidencyPlan:
        """Read :meth:`to_dict`'s form; raises ValueError naming the field that is wrong."""
        if data.get("format", PLAN_FORMAT) != PLAN_FORMAT:
            raise ValueError(f"format {data.get('format')!r} is not {PLAN_FORMAT!r}")
        if data.get("version", PLAN_FORMAT_VERSION) != PLAN_FORMAT_VERSION:
            raise ValueError(f"version {data.get('version')!r} is not supported (expected {PLAN_FORMAT_VERSION})")
        for key in ("n_experts", "bytes_hi", "budgets_bytes", "hi", "lo"):
            if key not in data:
                raise ValueError(f"residency plan: field {key!r} is missing")
        return cls(n_experts=data["n_experts"], bytes_hi=data["bytes_hi"], bytes_lo=data.get("bytes_lo"),
                   budgets_bytes=tuple(data["budgets_bytes"]), hi=tuple(tuple(h) for h in data["hi"]),
                   lo=tuple(tuple(lw) for lw in data["lo"]))

    def diff(self, other: ResidencyPlan) -> tuple[list[list[Move]], list[list[Move]]]:
        """Moves that turn this plan into ``other``: ``(promotions, demotions)``, one list per layer.

        A promotion moves an expert to a higher tier (host -> lo, host -> hi, lo -> hi); a demotion
        to a lower one. Within a layer, promotions come hottest-target first (to hi before to lo),
        then by id; demotions by id.
        """
        if other.n_layers != self.n_layers or other.n_experts != self.n_experts:
            raise ValueError(f"plans differ in shape: {self.n_layers}x{self.n_experts} vs "
                             f"{other.n_layers}x{other.n_experts}")
        promotions: list[list[Move]] = []
        demotions: list[list[Move]] = []
        for layer in range(self.n_layers):
            a, b = self._codes[layer], other._codes[layer]
            up = np.flatnonzero(b > a)
            down = np.flatnonzero(b < a)
            up = up[np.lexsort((up, -b[up]))]
            promotions.append([Move(layer, int(e), TIER_NAMES[a[e]], TIER_NAMES[b[e]]) for e in up])
            demotions.append([Move(layer, int(e), TIER_NAMES[a[e]], TIER_NAMES[b[e]]) for e in down])
        return promotions, demotions


def plan_static(hotness: np.ndarray, budgets_bytes: np.ndarray | Sequence[int], bytes_hi: int,
                bytes_lo: int | None = None, *,
                objective: Literal["precision", "coverage"] = "precision") -> ResidencyPlan:
    """Per layer, the hottest experts that fit the layer's budget (a budget-feasible top-n).

    ``hotness`` ``[L, E]``: each expert's share of routed tokens per layer (e.g. ``RouterTrace.hotness()``).
    Experts are ranked by share (ties: lower id first).

    ``objective="precision"`` (CoX-MoE, and DynaExq's hot set): as many of the hottest experts as fit
    go to ``hi``; where ``bytes_lo`` is given, the budget left after them holds low-precision copies
    of the next-hottest experts. ``objective="coverage"`` (DynaExq's full rule): first make as many
    experts resident as the budget allows (each in ``lo`` at least), then upgrade the hottest of them
    to ``hi`` while the budget holds; with a budget that fits every expert in ``lo`` this is
    DynaExq's "hot experts in hi, every other expert in lo" plan. Without ``bytes_lo`` both are the same.
    """
    hot = _nonneg_matrix("hotness", hotness)
    if hot.ndim != 2:
        raise ValueError(f"hotness must be [n_layers, n_experts], got shape {list(hot.shape)}")
    n_layers, n_experts = hot.shape
    budgets = np.asarray(budgets_bytes)
    if budgets.shape != (n_layers,):
        raise ValueError(f"budgets_bytes has shape {list(budgets.shape)}, expected [{n_layers}]")
    budgets_int = [_as_int(f"budgets_bytes[{i}]", b) for i, b in enumerate(budgets.tolist())]
    b_hi = _as_int("bytes_hi", bytes_hi, 1)
    b_lo = None if bytes_lo is None else _as_int("bytes_lo", bytes_lo, 1)
    if b_lo is not None and b_lo >= b_hi:
        raise ValueError(f"bytes_lo ({b_lo}) must be smaller than bytes_hi ({b_hi})")
    if objective not in ("precision", "coverage"):
        raise ValueError(f"objective must be 'precision' or 'coverage', got {objective!r}")
    his: list[tuple[int, ...]] = []
    los: list[tuple[int, ...]] = []
    for layer in range(n_layers):
        budget = budgets_int[layer]
        order = rank_experts(hot[layer])
        if b_lo is None:
            n_hi, n_lo = min(n_experts, budget // b_hi), 0
        elif objective == "precision":
            n_hi = min(n_experts, budget // b_hi)
            n_lo = min(n_experts - n_hi, (budget - n_hi * b_hi) // b_lo)
        else:
            n_resident = min(n_experts, budget // b_lo)
            n_hi = min(n_resident, (budget - n_resident * b_lo) // (b_hi - b_lo))
            n_lo = n_resident - n_hi
        his.append(tuple(order[:n_hi].tolist()))
        los.append(tuple(order[n_hi:n_hi + n_lo].tolist()))
    return ResidencyPlan(n_experts=n_experts, bytes_hi=b_hi, bytes_lo=b_lo, budgets_bytes=tuple(budgets_int),
                         hi=tuple(his), lo=tuple(los))


# ------------------------------------------------------------------------------------------ dynamic

class ReplanResult(NamedTuple):
    """What one re-plan decided: the new plan, the moves from the old one, and exchanges per layer."""

    plan: ResidencyPlan
    promotions: list[list[Move]]
    demotions: list[list[Move]]
    exchanges: list[int]


class DynamicResidency:
    """Re-plans the resident set from long-horizon hotness while serving (DynaExq-style promote/demote).

    Hotness is an exponential moving average of per-layer expert shares over routed tokens, with a
    half-life of ``half_life_tokens`` tokens (the mean age of the evidence is ``half_life / ln 2``
    tokens). Every ``replan_interval_tokens`` tokens the plan is revised by exchanges of tiers
    between two experts: the hottest expert below a tier boundary (hi vs lo/host, lo vs host) takes
    the place of the coldest one above it only if its EMA share exceeds that one's by more than the
    ``hysteresis`` fraction (``share_new > share_old * (1 + hysteresis)``), at most
    ``max_swaps_per_replan`` exchanges per layer, each time the qualifying exchange that raises
    ``sum(share * tier code)`` the most (codes: host 0, lo 1, hi 2; ties: the hi boundary). Exchanges keep the
    number of hi and lo experts per layer, so the bytes used never change and the budget holds.

    An expert coming from the host into ``hi`` pushes the coldest ``hi`` expert down to ``lo`` (and
    the coldest ``lo`` expert to the host) when that keeps the hotter one resident; this counts as
    one exchange. Each exchange promotes exactly one expert, so a re-plan's promotions per layer are
    at most ``max_swaps_per_replan``. The mechanism (background copies, stable handles) is the
    engine's: it receives the promotions and demotions of :class:`ReplanResult`.
    """

    def __init__(self, plan: ResidencyPlan, *, half_life_tokens: float, replan_interval_tokens: int,
                 hysteresis: float, max_swaps_per_replan: int, initial_hotness: np.ndarray | None = None) -> None:
        self.half_life_tokens = _as_float("half_life_tokens", half_life_tokens, strict=True)
        self.replan_interval_tokens = _as_int("replan_interval_tokens", replan_interval_tokens, 1)
        self.hysteresis = _as_float("hysteresis", hysteresis)
        self.max_swaps_per_replan = _as_int("max_swaps_per_replan", max_swaps_per_replan)
        self._plan = plan
        shape = (plan.n_layers, plan.n_experts)
        self._decay_per_token = 0.5 ** (1.0 / self.half_life_tokens)
        if initial_hotness is None:
            self._shares = np.zeros(shape)
            self._has_data = np.zeros(plan.n_layers, bool)
        else:
            self._shares = _nonneg_matrix("initial_hotness", initial_hotness, shape).copy()
            self._has_data = self._shares.sum(axis=1) > 0
        self._tokens_since_replan = 0
        self.tokens_seen = 0
        """Tokens counted by :meth:`update` so far."""

    @classmethod
    def from_hotness(cls, hotness: np.ndarray, budgets_bytes: np.ndarray | Sequence[int], bytes_hi: int,
                     bytes_lo: int | None = None, *, objective: Literal["precision", "coverage"] = "precision",
                     half_life_tokens: float, replan_interval_tokens: int, hysteresis: float,
                     max_swaps_per_replan: int) -> DynamicResidency:
        """Start from :func:`plan_static` on ``hotness`` (a profile), which also seeds the EMA."""
        plan = plan_static(hotness, budgets_bytes, bytes_hi, bytes_lo, objective=objective)
        return cls(plan, half_life_tokens=half_life_tokens, replan_interval_tokens=replan_interval_tokens,
                   hysteresis=hysteresis, max_swaps_per_replan=max_swaps_per_replan, initial_hotness=hotness)

    @property
    def plan(self) -> ResidencyPlan:
        """The plan in force (the last re-plan's, or the initial one)."""
        return self._plan

    @property
    def ema_shares(self) -> np.ndarray:
        """EMA of each expert's share of routed tokens per layer: a copy, float64 ``[L, E]``."""
        return self._shares.copy()

    def update(self, layer_counts: np.ndarray, tokens: int) -> ReplanResult | None:
        """Count one step: ``layer_counts`` ``[L, E]`` routed tokens per expert over ``tokens`` tokens.

        The step's per-layer shares enter the EMA with weight ``1 - decay ** tokens``; a layer with
        no routed tokens in the step keeps its EMA. Returns the re-plan when this step completes a
        re-plan interval, else None.
        """
        counts = _nonneg_matrix("layer_counts", layer_counts, self._shares.shape)
        n = _as_int("tokens", tokens)
        totals = counts.sum(axis=1)
        seen = totals > 0
        if n and seen.any():
            keep = self._decay_per_token ** n
            fresh = seen & ~self._has_data
            old = seen & self._has_data
            self._shares[old] = keep * self._shares[old] + (1.0 - keep) * (counts[old] / totals[old, None])
            self._shares[fresh] = counts[fresh] / totals[fresh, None]
            self._has_data |= seen
        self.tokens_seen += n
        self._tokens_since_replan += n
        if self._tokens_since_replan >= self.replan_interval_tokens:
            self._tokens_since_replan = 0
            return self.replan()
        return None

    def _beats(self, challenger: float, incumbent: float) -> bool:
        return challenger > incumbent and challenger > incumbent * (1.0 + self.hysteresis)

    def replan(self) -> ReplanResult:
        """Revise the plan now from the EMA (see the class docstring) and make it the plan in force."""
        old = self._plan
        codes = old.tier_codes().astype(np.int8)  # writable copy
        exchanges: list[int] = []
        hi_c, lo_c, host_c = TIER_CODES["hi"], TIER_CODES["lo"], TIER_CODES["host"]
        for layer in range(old.n_layers):
            s = self._shares[layer]
            tiers = codes[layer]
            done = 0
            while done < self.max_swaps_per_replan:
                hi_ids = np.flatnonzero(tiers == hi_c)
                lo_ids = np.flatnonzero(tiers == lo_c)
                host_ids = np.flatnonzero(tiers == host_c)
                # candidate exchanges as {expert: new tier code}; the one raising the score
                # sum(share * tier code) the most wins (ties: the hi boundary)
                options: list[dict[int, int]] = []
                below_hi = np.flatnonzero(tiers != hi_c)
                if hi_ids.size and below_hi.size:
                    w, c = _weakest(hi_ids, s), _strongest(below_hi, s)
                    if self._beats(s[c], s[w]):
                        if tiers[c] == lo_c or not lo_ids.size:
                            options.append({c: hi_c, w: int(tiers[c])})
                        else:  # from the host while a lo tier exists: w drops to lo if it beats the coldest lo
                            x = _weakest(lo_ids, s)
                            options.append({c: hi_c, w: lo_c, x: host_c} if s[w] >= s[x] else {c: hi_c, w: host_c})
                if lo_ids.size and host_ids.size:
                    w, c = _weakest(lo_ids, s), _strongest(host_ids, s)
                    if self._beats(s[c], s[w]):
                        options.append({c: lo_c, w: host_c})
                if not options:
                    break
                gains = [sum(s[e] * (code - int(tiers[e])) for e, code in opt.items()) for opt in options]
                for e, code in options[int(np.argmax(gains))].items():
                    tiers[e] = code
                done += 1
            exchanges.append(done)
        new = ResidencyPlan(n_experts=old.n_experts, bytes_hi=old.bytes_hi, bytes_lo=old.bytes_lo,
                            budgets_bytes=old.budgets_bytes,
                            hi=tuple(tuple(np.flatnonzero(t == hi_c).tolist()) for t in codes),
                            lo=tuple(tuple(np.flatnonzero(t == lo_c).tolist()) for t in codes))
        promotions, demotions = old.diff(new)
        self._plan = new
        return ReplanResult(new, promotions, demotions, exchanges)


# ------------------------------------------------------------------------------------------ cache

class CacheAccess(NamedTuple):
    """Outcome of one :meth:`ExpertCache.access`: expert ids that hit, missed, and were evicted."""

    hits: list[int]
    misses: list[int]
    evictions: list[int]


class StepAccess(NamedTuple):
    """Outcome of one :meth:`ExpertCache.access_step`, ``[L, E]`` masks: hits, misses, evicted and
    admitted experts; ``rank`` orders each layer's victims (eviction order: lower first)."""

    hits: np.ndarray
    misses: np.ndarray
    evicted: np.ndarray
    admitted: np.ndarray
    rank: np.ndarray

    def layer(self, li: int) -> tuple[CacheAccess, tuple[int, ...]]:
        """Layer ``li`` as :meth:`ExpertCache.access` returns it, and its admitted experts."""
        ev = np.flatnonzero(self.evicted[li])
        ev = ev[np.argsort(self.rank[li, ev])]
        return (CacheAccess(np.flatnonzero(self.hits[li]).tolist(), np.flatnonzero(self.misses[li]).tolist(),
                            ev.tolist()), tuple(np.flatnonzero(self.admitted[li]).tolist()))


class TransitionTable:
    """Co-occurrence of routed experts between consecutive MoE layers, for next-layer prefetch.

    ``counts[l, i, j]`` is the number of tokens routed to expert ``i`` at MoE layer ``l`` and to
    expert ``j`` at MoE layer ``l + 1`` (layers are MoE-layer indices, as in router traces).
    Learned online with :meth:`observe` and/or from a recorded trace with :meth:`from_trace`.
    """

    def __init__(self, n_layers: int, n_experts: int) -> None:
        self.n_layers = _as_int("n_layers", n_layers, 1)
        self.n_experts = _as_int("n_experts", n_experts, 1)
        self.counts = np.zeros((max(self.n_layers - 1, 0), self.n_experts, self.n_experts), np.float64)

    @classmethod
    def from_expert_ids(cls, expert_ids: np.ndarray, n_experts: int) -> TransitionTable:
        """A table learned from per-token routes ``[T, L, K]`` (slots of :data:`NO_EXPERT` ignored)."""
        ids = np.asarray(expert_ids)
        if ids.ndim != 3:
            raise ValueError(f"expert_ids must be [n_tokens, n_layers, top_k], got shape {list(ids.shape)}")
        table = cls(ids.shape[1], n_experts)
        table.observe(ids)
        return table

    @classmethod
    def from_trace(cls, trace: Any) -> TransitionTable:
        """A table learned from a router trace (anything with ``expert_ids`` ``[T, L, K]`` and ``n_experts``)."""
        return cls.from_expert_ids(trace.expert_ids, int(trace.n_experts))

    def observe(self, expert_ids: np.ndarray) -> None:
        """Count the routes of a step: ``expert_ids`` ``[T, L, K]`` (all MoE layers of each token)."""
        ids = np.asarray(expert_ids)
        if ids.ndim != 3 or ids.shape[1] != self.n_layers:
            raise ValueError(f"expert_ids must be [n_tokens, {self.n_layers}, top_k], got {list(ids.shape)}")
        if ids.size and (ids.min() < NO_EXPERT or ids.max() >= self.n_experts):
            raise ValueError(f"expert ids must lie in [{NO_EXPERT}, {self.n_experts})")
        ids = ids.astype(np.int64)
        k = ids.shape[2]
        for layer in range(self.n_layers - 1):
            a = np.repeat(ids[:, layer, :], k, axis=1).reshape(-1)
            b = np.tile(ids[:, layer + 1, :], (1, k)).reshape(-1)
            ok = (a >= 0) & (b >= 0)
            np.add.at(self.counts[layer], (a[ok], b[ok]), 1.0)

    def scores(self, next_layer: int, current_ids: Iterable[int] | Mapping[int, float]) -> np.ndarray:
        """Expected routes to each expert of ``next_layer`` given the experts active at ``next_layer - 1``.

        ``current_ids`` is a set of expert ids (each counted once) or ``{expert: weight}`` (e.g. its
        token count). Each current expert contributes its row of conditional frequencies
        ``P(next = j | current = i)``; experts never seen contribute nothing. Float64 ``[E]``.
        """
        layer = _as_int("next_layer", next_layer, 1) - 1
        if layer >= self.n_layers - 1:
            raise ValueError(f"next_layer must lie in [1, {self.n_layers}), got {next_layer}")
        weights = dict(current_ids) if isinstance(current_ids, Mapping) else dict.fromkeys(current_ids, 1.0)
        out = np.zeros(self.n_experts)
        for expert, weight in sorted(weights.items()):
            row = self.counts[layer, int(expert)]
            total = row.sum()
            if total > 0 and weight > 0:
                out += float(weight) * row / total
        return out

    def predict(self, next_layer: int, current_ids: Iterable[int] | Mapping[int, float], k: int,
                exclude: Iterable[int] = ()) -> list[int]:
        """The ``k`` experts of ``next_layer`` most likely to be routed to, hottest first.

        Ranked by :meth:`scores`, then by how often each expert of ``next_layer`` was seen at all
        (its marginal count), then by id, so a cold table still returns ``k`` ids.
        """
        k = _as_int("k", k)
        score = self.scores(next_layer, current_ids)
        marginal = self.counts[next_layer - 1].sum(axis=0)
        ids = np.arange(self.n_experts)
        order = np.lexsort((ids, -marginal, -score))
        skip = {int(e) for e in exclude}
        return [int(e) for e in order if int(e) not in skip][:k]


class ExpertCache:
    """An expert cache per MoE layer with LRU or LFU eviction, and next-layer prefetch candidates.

    Capacity is in experts per layer (use :meth:`from_budgets` for bytes). The experts of one
    :meth:`access` are needed together, so none of them is evicted by another; a miss that finds no
    room (capacity 0, or every cached expert is in use by this access) is not admitted. ``lru``
    evicts the least recently used; ``lfu`` evicts the least frequently accessed, counting every
    access since the cache was made (not only while cached), then the least recently used; remaining
    ties go to the higher id. Prefetch candidates come from a :class:`TransitionTable`.
    """

    def __init__(self, n_layers: int, n_experts: int, capacity_experts: int | Sequence[int], *,
                 policy: Literal["lru", "lfu"] = "lru", transitions: TransitionTable | None = None) -> None:
        self.n_layers = _as_int("n_layers", n_layers, 1)
        self.n_experts = _as_int("n_experts", n_experts, 1)
        if policy not in ("lru", "lfu"):
            raise ValueError(f"policy must be 'lru' or 'lfu', got {policy!r}")
        self.policy = policy
        caps = [capacity_experts] * self.n_layers if isinstance(capacity_experts, (int, np.integer)) \
            else list(capacity_experts)
        if len(caps) != self.n_layers:
            raise ValueError(f"capacity_experts has {len(caps)} entries, expected {self.n_layers}")
        self.capacity_experts = [min(_as_int(f"capacity_experts[{i}]", c), self.n_experts)
                                 for i, c in enumerate(caps)]
        self.transitions = transitions if transitions is not None else TransitionTable(self.n_layers, self.n_experts)
        if (self.transitions.n_layers, self.transitions.n_experts) != (self.n_layers, self.n_experts):
            raise ValueError("transitions table shape differs from the cache's")
        # The clock of each cached expert's last use (-1: not cached). Every use takes a fresh tick,
        # so clocks never tie among cached experts.
        self._last = np.full((self.n_layers, self.n_experts), -1, np.int64)
        self._size = [0] * self.n_layers
        self._freq = np.zeros((self.n_layers, self.n_experts), np.int64)
        self._clock = 0
        self.hits = 0
        """Hits over all accesses."""
        self.misses = 0
        """Misses over all accesses."""
        self.evictions = 0
        """Evictions over all accesses and prefetches."""

    @classmethod
    def from_budgets(cls, n_experts: int, budgets_bytes: Sequence[int] | np.ndarray, bytes_per_expert: int, *,
                     policy: Literal["lru", "lfu"] = "lru",
                     transitions: TransitionTable | None = None) -> ExpertCache:
        """A cache holding ``budgets_bytes[l] // bytes_per_expert`` experts at layer ``l``."""
        per = _as_int("bytes_per_expert", bytes_per_expert, 1)
        caps = [_as_int(f"budgets_bytes[{i}]", b) // per for i, b in enumerate(np.asarray(budgets_bytes).tolist())]
        return cls(len(caps), n_experts, caps, policy=policy, transitions=transitions)

    def cached(self, layer: int) -> list[int]:
        """Expert ids cached at ``layer``, sorted."""
        return np.flatnonzero(self._last[layer] >= 0).tolist()

    def _admit_all(self, layer: int, ids: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Hits refreshed, misses admitted in order (evicting as needed), one clock tick per id, as if
        each were handled in turn; returns (hits, misses, evicted).

        Handled at once: the ids of one call are in use together, so none is evicted by another, and
        the experts outside them are not touched while their slots are handed out, so the eviction
        order (LRU: oldest use first; LFU: fewest uses, then oldest) is fixed for the whole call."""
        if not ids:
            return [], [], []
        last = self._last[layer]
        idx = np.asarray(ids, dtype=np.int64)
        held = last[idx] >= 0
        miss_at = np.flatnonzero(~held)
        room = max(0, self.capacity_experts[layer] - self._size[layer])
        need = len(miss_at) - room
        victims = idx[:0]
        if need > 0:
            free = last >= 0
            free[idx] = False
            cand = np.flatnonzero(free)
            if len(cand):
                order = np.argsort(last[cand]) if self.policy == "lru" else \
                    np.lexsort((-cand, last[cand], self._freq[layer, cand]))
                victims = cand[order[:need]]
                last[victims] = -1
        taken = held.copy()
        taken[miss_at[:room + len(victims)]] = True
        last[idx[taken]] = self._clock + 1 + np.flatnonzero(taken)
        self._clock += len(idx)
        self._size[layer] += min(len(miss_at), room + len(victims)) - len(victims)
        return idx[held].tolist(), idx[miss_at].tolist(), victims.tolist()

    def _unique(self, layer: int, experts: Iterable[int]) -> list[int]:
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer must lie in [0, {self.n_layers}), got {layer}")
        seen = dict.fromkeys(experts.tolist() if isinstance(experts, np.ndarray) else experts)  # first-seen order
        seen.pop(NO_EXPERT, None)
        out = [int(e) for e in seen]
        if out and (min(out) < 0 or max(out) >= self.n_experts):
            bad = [e for e in out if not 0 <= e < self.n_experts]
            raise ValueError(f"expert ids {bad} are outside [0, {self.n_experts})")
        return out

    def access(self, layer: int, experts: Iterable[int]) -> CacheAccess:
        """The experts routed to at ``layer`` in one step (repeats and :data:`NO_EXPERT` ignored).

        Hits refresh recency; misses are admitted in the given order, evicting as needed.
        """
        ids = self._unique(layer, experts)
        if ids:
            self._freq[layer, ids] += 1  # ids are unique: one count each
        hits, misses, evicted = self._admit_all(layer, ids)
        self.hits += len(hits)
        self.misses += len(misses)
        self.evictions += len(evicted)
        return CacheAccess(hits, misses, evicted)

    def access_step(self, routed: np.ndarray) -> StepAccess:
        """:meth:`access` of every layer in turn, layer 0 first, with the experts routed at each
        (``routed`` ``[L, E]`` bool, ascending ids within a layer), as arrays: the same clocks, hits,
        admissions and victims (each layer's cache is its own; only the clock is shared, and it
        advances by the routed experts of each layer in order)."""
        routed = np.asarray(routed, dtype=bool)
        if routed.shape != self._last.shape:
            raise ValueError(f"routed must be [{self.n_layers}, {self.n_experts}], got {list(routed.shape)}")
        last, clock0 = self._last, self._clock
        held = last >= 0
        hit = routed & held
        miss = routed ^ hit
        n_miss = miss.sum(1)
        room = np.maximum(0, np.asarray(self.capacity_experts) - np.asarray(self._size))
        need = n_miss - room
        if (need > 0).any():
            cand = held & ~routed
            # Eviction order within a layer: LRU oldest use first; LFU fewest uses, then oldest (clocks never
            # tie among cached experts, so the key is unique and a layer's victims are the candidates whose
            # key is at most its need-th smallest).
            key = last if self.policy == "lru" else self._freq * (clock0 + 1) + last
            rank = np.where(cand, key, np.iinfo(np.int64).max)
            nth = np.sort(rank, axis=1)[np.arange(self.n_layers), np.maximum(need, 1) - 1]  # need <= E
            victim = cand & (rank <= np.where(need > 0, nth, -1)[:, None])
            n_vict = victim.sum(1)
            last[victim] = -1
        else:  # room for every miss
            rank = np.zeros(last.shape, np.int64)
            victim = np.zeros(last.shape, bool)
            n_vict = np.zeros(self.n_layers, np.int64)
        # Misses admitted in expert order while there is room (all of them unless a layer ran out of victims).
        short = room + n_vict < n_miss
        admitted = miss & (np.cumsum(miss, axis=1) <= (room + n_vict)[:, None]) if short.any() else miss
        self._freq += routed
        # Each routed expert takes the next tick in layer-then-expert order; hits and admissions keep theirs.
        at = np.flatnonzero(routed)
        n_routed = len(at)
        ticks = np.arange(clock0 + 1, clock0 + 1 + n_routed)
        if admitted is not miss:
            used = (hit | admitted).ravel()[at]
            at, ticks = at[used], ticks[used]
        np.put(last, at, ticks)
        self._clock = clock0 + n_routed
        self._size = (np.asarray(self._size) + admitted.sum(1) - n_vict).tolist()
        self.hits += int(np.count_nonzero(hit))
        self.misses += int(n_miss.sum())
        self.evictions += int(n_vict.sum())
        return StepAccess(hit, miss, victim, admitted, rank)

    def prefetch(self, layer: int, experts: Iterable[int]) -> list[int]:
        """Admit ``experts`` at ``layer`` ahead of use (no hit or miss counted); returns the evicted ids."""
        ids = self._unique(layer, experts)
        _, _, evicted = self._admit_all(layer, ids)
        self.evictions += len(evicted)
        return evicted

    def observe(self, expert_ids: np.ndarray) -> None:
        """Learn layer-to-layer co-occurrence from a step's routes ``[T, L, K]`` (see :class:`TransitionTable`)."""
        self.transitions.observe(expert_ids)

    def prefetch_candidates(self, next_layer: int, current_ids: Iterable[int] | Mapping[int, float], k: int,
                            *, exclude_cached: bool = True) -> list[int]:
        """Up to ``k`` experts of ``next_layer`` to prefetch, most likely first, given the experts
        (or ``{expert: tokens}``) routed to at ``next_layer - 1``; already cached ones are skipped
        unless ``exclude_cached`` is False."""
        exclude = self.cached(next_layer) if exclude_cached else ()
        return self.transitions.predict(next_layer, current_ids, k, exclude=exclude)
