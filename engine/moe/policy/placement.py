"""Expert parallelism as data: which rank holds which experts, who computes each routed token, what moves.

With expert parallelism (``parallel.ep_size`` = N ranks) every rank runs the attention and dense
layers on every token of a step (replicated), and each MoE layer's experts are partitioned across
the ranks. A :class:`Placement` says, per MoE layer and expert, the ranks holding a copy of it:

- ``contiguous``: expert ``e`` of E on rank ``e * N // E`` (blocks of consecutive experts);
- ``hotness``: experts ordered by recorded hotness, each put on the least-loaded rank that still has a
  free slot (greedy longest-processing-time), so each rank holds E/N experts and about 1/N of the load;
- ``eplb``: as DeepSeek's EPLB, ``redundant`` extra copies go, one at a time, to the expert with the
  highest load per copy; the E + R copies (each carrying its expert's load / copies) are then packed
  onto the ranks in the same greedy way, never two copies of one expert on one rank.

:func:`assign_pairs` says which rank computes each (token, slot) pair of a step: the rank of the
expert's only copy, or, for a replicated expert, its pairs in token order split into near-equal
contiguous runs, one per copy (:func:`~engine.moe.policy.replication.split_tokens`).
:func:`rank_loads` gives the same per-rank counts from routed counts alone (what a backend without
tensors has). :func:`step_traffic` prices one MoE layer's communication in bytes for the scheme the
live engine runs (see its docstring), and :class:`EPStats` accumulates per-rank tokens, load
imbalance (max / mean tokens per rank per layer) and bytes over a run, as both backends record them
(:func:`ep_record` is the run's record, the same JSON from the live engine and the simulator).
:func:`chunk_bounds` cuts a step's rows into the combine's chunks (``parallel.ep_combine_chunks``);
:class:`CopyIndex` and :func:`chunk_loads` give the simulator each rank's tokens per expert, by the
same split, without tensors.

Pure and deterministic (numpy and the standard library).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from engine.moe.policy.replication import split_tokens

PlacementPolicy = Literal["contiguous", "hotness", "eplb"]
PLACEMENTS: tuple[PlacementPolicy, ...] = ("contiguous", "hotness", "eplb")


@dataclass(frozen=True)
class Placement:
    """Per MoE layer, per expert, the ranks holding a copy (ascending): ``copies[layer][expert]``."""

    n_ranks: int
    n_experts: int
    policy: str
    copies: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def n_layers(self) -> int:
        return len(self.copies)

    def experts_on(self, layer: int, rank: int) -> tuple[int, ...]:
        """Experts of MoE layer ``layer`` with a copy on ``rank``, ascending."""
        return tuple(e for e, ranks in enumerate(self.copies[layer]) if rank in ranks)

    def slots(self, layer: int) -> list[int]:
        """Expert copies each rank holds in MoE layer ``layer`` (its share of the expert memory)."""
        out = [0] * self.n_ranks
        for ranks in self.copies[layer]:
            for r in ranks:
                out[r] += 1
        return out

    def replicas(self, layer: int) -> dict[int, int]:
        """Experts of ``layer`` with more than one copy -> number of copies."""
        return {e: len(r) for e, r in enumerate(self.copies[layer]) if len(r) > 1}

    def describe(self) -> dict[str, Any]:
        """JSON-able summary: the policy, experts per rank per layer, replicated experts per layer."""
        return {"policy": self.policy, "ranks": self.n_ranks,
                "experts_per_rank": [self.slots(li) for li in range(self.n_layers)],
                "replicated": [{str(e): c for e, c in self.replicas(li).items()} for li in range(self.n_layers)],
                "experts": [[list(self.experts_on(li, r)) for r in range(self.n_ranks)]
                            for li in range(self.n_layers)]}


def _capacities(n_items: int, n_ranks: int) -> list[int]:
    """Slots per rank for ``n_items`` copies: as equal as possible, the first ranks one more."""
    q, r = divmod(n_items, n_ranks)
    return [q + 1] * r + [q] * (n_ranks - r)


def _pack(loads: Sequence[float], experts: Sequence[int], n_ranks: int) -> list[list[int]]:
    """Greedy balanced packing of copies (``loads[i]`` of expert ``experts[i]``) onto ranks with equal
    slot counts: heaviest first, each onto the least-loaded rank with a free slot that holds no copy of
    the same expert (lowest rank on ties). Returns the ranks of each expert's copies."""
    caps = _capacities(len(loads), n_ranks)
    load = [0.0] * n_ranks
    held: list[set[int]] = [set() for _ in range(n_ranks)]
    order = sorted(range(len(loads)), key=lambda i: (-loads[i], experts[i], i))
    out: dict[int, list[int]] = {}
    for i in order:
        e = experts[i]
        ok = [r for r in range(n_ranks) if caps[r] > 0 and e not in held[r]]
        if not ok:  # every rank with a free slot holds e already: take a rank without e (one slot over)
            ok = [r for r in range(n_ranks) if e not in held[r]]
        r = min(ok, key=lambda q: (load[q], q))
        caps[r] -= 1
        load[r] += loads[i]
        held[r].add(e)
        out.setdefault(e, []).append(r)
    return [sorted(out[e]) for e in range(max(experts) + 1)]


def eplb_copies(hotness: Sequence[float], redundant: int, n_ranks: int) -> list[int]:
    """Copies per expert after adding ``redundant`` copies one at a time to the expert with the highest
    load per copy (lowest index on ties), at most one copy per rank."""
    hot = np.asarray(hotness, dtype=np.float64)
    copies = np.ones(hot.shape[0], np.int64)
    for _ in range(int(redundant)):
        open_ = np.flatnonzero(copies < n_ranks)
        if not open_.size:
            break
        per_copy = hot[open_] / copies[open_]
        copies[int(open_[np.lexsort((open_, -per_copy))[0]])] += 1
    return [int(c) for c in copies]


def place_experts(policy: str, n_ranks: int, n_experts: int, n_layers: int,
                  hotness: np.ndarray | None = None, redundant: int = 0) -> Placement:
    """The placement of ``n_experts`` experts in each of ``n_layers`` MoE layers on ``n_ranks`` ranks.

    ``hotness`` ``[n_layers, n_experts]`` (token shares per layer, e.g. a router trace's) drives
    ``hotness`` and ``eplb``; without it every expert is equally hot. ``redundant`` (``eplb`` only) is
    the number of extra copies per layer, at most ``n_experts * (n_ranks - 1)``.
    """
    if policy not in PLACEMENTS:
        raise ValueError(f"placement policy {policy!r} is not one of {', '.join(PLACEMENTS)}")
    if n_ranks < 1 or n_ranks > n_experts:
        raise ValueError(f"n_ranks={n_ranks}: must be between 1 and the {n_experts} experts")
    if redundant and policy != "eplb":
        raise ValueError(f"redundant={redundant}: only the eplb placement makes redundant copies")
    if not 0 <= redundant <= n_experts * (n_ranks - 1):
        raise ValueError(f"redundant={redundant}: must be between 0 and n_experts * (n_ranks - 1) = "
                         f"{n_experts * (n_ranks - 1)}")
    if hotness is None:
        hot = np.full((n_layers, n_experts), 1.0 / n_experts)
    else:
        hot = np.asarray(hotness, dtype=np.float64)
        if hot.shape != (n_layers, n_experts):
            raise ValueError(f"hotness has shape {hot.shape}; expected ({n_layers}, {n_experts})")
    layers = []
    for li in range(n_layers):
        if policy == "contiguous":
            layers.append(tuple((e * n_ranks // n_experts,) for e in range(n_experts)))
            continue
        counts = eplb_copies(hot[li], redundant, n_ranks) if policy == "eplb" else [1] * n_experts
        experts = [e for e in range(n_experts) for _ in range(counts[e])]
        loads = [float(hot[li, e]) / counts[e] for e in experts]
        layers.append(tuple(tuple(r) for r in _pack(loads, experts, n_ranks)))
    return Placement(n_ranks, n_experts, policy, tuple(layers))


def assign_pairs(ids: np.ndarray, placement: Placement, layer: int) -> np.ndarray:
    """The rank that computes each (token, slot) pair of a step: ``[T, K]`` int64, -1 where ``ids`` is
    -1 (a skipped slot). A replicated expert's pairs, in row-major (token) order, are split into
    contiguous near-equal runs over its copies, in the order of :attr:`Placement.copies`."""
    ids = np.asarray(ids)
    flat = ids.reshape(-1)
    out = np.full(flat.shape, -1, np.int64)
    copies = placement.copies[layer]
    primary = np.array([c[0] for c in copies], np.int64)
    valid = flat >= 0
    out[valid] = primary[flat[valid]]
    for e, ranks in enumerate(copies):
        if len(ranks) == 1:
            continue
        pos = np.flatnonzero(flat == e)
        start = 0
        for r, n in zip(ranks, split_tokens(pos.size, len(ranks)), strict=True):
            out[pos[start: start + n]] = r
            start += n
    return out.reshape(ids.shape)


def rank_loads(counts: Sequence[int] | np.ndarray, placement: Placement, layer: int) -> np.ndarray:
    """(token, slot) pairs each rank computes in MoE layer ``layer`` given the routed ``counts[e]``:
    int64 ``[n_ranks]``, equal to counting :func:`assign_pairs` by rank."""
    out = np.zeros(placement.n_ranks, np.int64)
    for e, n in enumerate(np.asarray(counts).tolist()):
        if not n:
            continue
        ranks = placement.copies[layer][e]
        for r, part in zip(ranks, split_tokens(int(n), len(ranks)), strict=True):
            out[r] += part
    return out


def chunk_bounds(n_tokens: int, chunks: int) -> list[int]:
    """Row bounds of the combine's chunks of a ``n_tokens``-row step: ``chunks`` (at most one a row)
    near-equal runs, ``[0, ..., n_tokens]``."""
    c = max(1, min(int(chunks), int(n_tokens)))
    return np.linspace(0, n_tokens, c + 1).round().astype(int).tolist()


@dataclass(frozen=True)
class CopyIndex:
    """Every expert copy of a :class:`Placement` as flat arrays over (MoE layer, expert, copy): what
    prices all MoE layers of a step at once. ``nth`` is the copy's position among its expert's
    copies (the order of :attr:`Placement.copies`), ``n_copies`` the expert's copy count."""

    n_layers: int
    n_ranks: int
    layer: np.ndarray
    expert: np.ndarray
    rank: np.ndarray
    nth: np.ndarray
    n_copies: np.ndarray

    @classmethod
    def of(cls, placement: Placement) -> CopyIndex:
        rows = [(li, e, r, i, len(ranks)) for li in range(placement.n_layers)
                for e, ranks in enumerate(placement.copies[li]) for i, r in enumerate(ranks)]
        a = np.asarray(rows, np.int64).reshape(-1, 5)
        return cls(placement.n_layers, placement.n_ranks, *(a[:, j].copy() for j in range(5)))

    def shares(self, counts: np.ndarray) -> np.ndarray:
        """Tokens each copy computes given the routed ``counts`` ``[MoE layers, E]``: the near-equal
        split of :func:`~engine.moe.policy.replication.split_tokens` (the first ``n % copies`` copies
        take one more), as :func:`rank_loads` and :func:`assign_pairs` split them."""
        q, r = np.divmod(np.asarray(counts, np.int64)[self.layer, self.expert], self.n_copies)
        return q + (self.nth < r)

    def by_rank(self, values: np.ndarray) -> np.ndarray:
        """Per-copy ``values`` summed per (MoE layer, rank): ``[MoE layers, ranks]`` float64."""
        n = self.n_ranks
        return np.bincount(self.layer * n + self.rank, weights=values,
                           minlength=self.n_layers * n).reshape(self.n_layers, n)


def chunk_loads(ids: np.ndarray, placement: Placement, bounds: Sequence[int]) -> np.ndarray:
    """Pairs of each (combine chunk, MoE layer, rank, expert) of a step whose routed ids are ``ids``
    ``[T, MoE layers, K]`` (-1 = skipped): ``[chunks, layers, ranks, E]`` int64. Each pair's rank is
    :func:`assign_pairs`' (called for the layers with a replicated expert; the others read the only copy)."""
    ids = np.asarray(ids, np.int64)
    t, n_layers, _ = ids.shape
    n, e = placement.n_ranks, placement.n_experts
    primary = np.array([[c[0] for c in layer] for layer in placement.copies], np.int64)  # [L, E]
    owner = primary[np.arange(n_layers)[None, :, None], np.maximum(ids, 0)]  # [T, L, K]
    for li in range(n_layers):
        if placement.replicas(li):
            owner[:, li] = assign_pairs(ids[:, li], placement, li)
    chunks = len(bounds) - 1
    chunk = np.repeat(np.arange(chunks), np.diff(np.asarray(bounds)))[:, None, None]  # [T, 1, 1]
    key = (((chunk * n_layers + np.arange(n_layers)[None, :, None]) * n + owner) * e + ids)[ids >= 0]
    return np.bincount(key, minlength=chunks * n_layers * n * e).reshape(chunks, n_layers, n, e)


def imbalance(loads: Sequence[int] | np.ndarray) -> float:
    """max / mean of per-rank loads (1.0 = perfectly balanced; 1.0 when nothing was routed)."""
    x = np.asarray(loads, dtype=np.float64)
    mean = x.mean() if x.size else 0.0
    return float(x.max() / mean) if mean > 0 else 1.0


def step_traffic(n_tokens: int, hidden: int, elem_bytes: int, n_ranks: int) -> tuple[int, int]:
    """(bytes dispatched, bytes combined) per rank for one MoE layer of a ``n_tokens``-token step.

    The live scheme: attention is replicated, so every rank already holds every token's hidden state
    and the dispatch moves nothing (each rank picks the pairs :func:`assign_pairs` gives it). The
    combine sums the ranks' partial outputs ``[T, H]`` (``elem_bytes`` per value) with an all-reduce;
    the figure is what a ring all-reduce sends from each rank, ``2 (N - 1) / N * T * H * elem_bytes``
    (a link model prices it with the link's bandwidth and ``2 (N - 1)`` latencies).
    """
    if n_ranks <= 1:
        return 0, 0
    return 0, int(2 * (n_ranks - 1) * n_tokens * hidden * elem_bytes // n_ranks)


@dataclass
class EPStats:
    """Per-rank tokens, load imbalance and bytes of a run, one MoE layer of one step at a time.

    ``add_layer`` takes one MoE layer's per-rank pair counts and the step's token count; ``end_step``
    closes a step. ``tokens[layer][rank]`` accumulates pairs computed; per step, ``steps`` keeps the
    bytes dispatched and combined (summed over MoE layers, per rank) and the mean over MoE layers of
    that step's max/mean imbalance.
    """

    n_ranks: int
    n_layers: int
    hidden: int
    elem_bytes: int
    tokens: np.ndarray = field(init=False)
    steps: list[dict[str, Any]] = field(default_factory=list)
    _step: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tokens = np.zeros((self.n_layers, self.n_ranks), np.int64)

    def reset(self) -> None:
        self.tokens[:] = 0
        self.steps = []
        self._step = {}

    def last_step(self) -> dict[str, Any] | None:
        """The step just closed: ``bytes_dispatched``, ``bytes_combined`` and ``imbalance`` (a step's row of
        ``mt_steps``), or None before the first."""
        if not self.steps:
            return None
        s = self.steps[-1]
        return {"bytes_dispatched": int(s["bytes_dispatched"]), "bytes_combined": int(s["bytes_combined"]),
                "imbalance": float(s["imbalance"])}

    def add_step(self, loads: np.ndarray, n_tokens: int) -> None:
        """Every MoE layer of a step at once (``loads`` ``[MoE layers, ranks]``), then :meth:`end_step`:
        the same figures as :meth:`add_layer` layer by layer."""
        x = np.asarray(loads, np.int64)
        self.tokens += x
        d, c = step_traffic(n_tokens, self.hidden, self.elem_bytes, self.n_ranks)
        s = self._step
        s["bytes_dispatched"] = s.get("bytes_dispatched", 0) + d * x.shape[0]
        s["bytes_combined"] = s.get("bytes_combined", 0) + c * x.shape[0]
        mean = x.mean(axis=1)
        s.setdefault("imbalance", []).extend(np.where(mean > 0, x.max(axis=1) / np.where(mean > 0, mean, 1.0),
                                                      1.0).tolist())
        tok = s.setdefault("tokens_per_rank", [0] * self.n_ranks)
        for r, m in enumerate(x.sum(axis=0).tolist()):
            tok[r] += int(m)
        self.end_step()

    def add_layer(self, layer: int, loads: np.ndarray, n_tokens: int) -> None:
        self.tokens[layer] += loads
        d, c = step_traffic(n_tokens, self.hidden, self.elem_bytes, self.n_ranks)
        s = self._step
        s["bytes_dispatched"] = s.get("bytes_dispatched", 0) + d
        s["bytes_combined"] = s.get("bytes_combined", 0) + c
        s.setdefault("imbalance", []).append(imbalance(loads))
        tok = s.setdefault("tokens_per_rank", [0] * self.n_ranks)
        for r, n in enumerate(loads.tolist()):
            tok[r] += int(n)

    def end_step(self) -> None:
        if not self._step:
            return
        s = self._step
        s["imbalance"] = float(np.mean(s["imbalance"]))
        self.steps.append(s)
        self._step = {}

    def summary(self) -> dict[str, Any]:
        """The run's figures, JSON-able: per-rank tokens (summed over layers), per-layer imbalance over
        the run, its mean and max, the mean per-step imbalance, bytes per step and in total."""
        per_layer = [imbalance(row) for row in self.tokens]
        n = len(self.steps)
        disp = [s["bytes_dispatched"] for s in self.steps]
        comb = [s["bytes_combined"] for s in self.steps]
        return {
            "ranks": self.n_ranks,
            "tokens_per_rank": [int(x) for x in self.tokens.sum(axis=0)],
            "tokens_per_rank_per_layer": self.tokens.tolist(),
            "imbalance_per_layer": per_layer,
            "imbalance_mean": float(np.mean(per_layer)) if per_layer else 1.0,
            "imbalance_max": float(np.max(per_layer)) if per_layer else 1.0,
            "step_imbalance_mean": float(np.mean([s["imbalance"] for s in self.steps])) if n else 1.0,
            "bytes_dispatched": int(sum(disp)),
            "bytes_combined": int(sum(comb)),
            "bytes_dispatched_per_step_mean": float(np.mean(disp)) if n else 0.0,
            "bytes_combined_per_step_mean": float(np.mean(comb)) if n else 0.0,
            "steps": self.steps,
        }


def ep_record(placement: Placement, stats: EPStats, combine_chunks: int, redundant: int,
              sm_partition: dict[str, Any] | None = None) -> dict[str, Any]:
    """A run's expert-parallel record (a result's ``meta["ep"]``), JSON-able: the scheme, the placement
    and :meth:`EPStats.summary`; the live engine and the simulator write the same fields.
    ``sm_partition``: on CUDA with ``execution.expert_sm_share`` < 1, the SMs expert compute holds and the
    CTAs the combine's collectives may use (or why there is no partition); None elsewhere."""
    return {"combine": "all_reduce", "dispatch": "none (attention replicated: every rank holds every token)",
            "combine_chunks": combine_chunks, "redundant_experts": redundant, "sm_partition": sm_partition,
            "placement": placement.describe(), **stats.summary()}
