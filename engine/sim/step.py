"""The step pricer: seconds of one engine step, from its layout, its expert plans and the profile.

The simulator prices what the engine's mechanism does with a plan (``engine/model/decoder.py``,
``engine/moe/experts.py``), operation by operation, and says here which operations overlap. A
*host-only* profile (no accelerator: both tiers are host memory, as on a CPU machine) prices the CPU
engine; a profile with a device prices the CUDA engine with the host as the slow tier.

Per step::

    step = step_overhead + token_overhead x T
         + per decoder layer: layer_overhead + dense products (q/k/v, o, router or dense MLP, shared
           expert) + attention (decode: one call over the decode batch; prefill: one per chunk)
           + MoE (below) [+ moe_layer_overhead with the hybrid expert executor]
         + the lm head over the sampled rows + copies the step's moves need

Overlap rules (what runs at the same time as what):

1. Everything on one processor runs in sequence: dense products, attention and experts of a layer,
   layer after layer (the engine issues them from one Python thread).
2. Micro-batches of a layer run one after the other; inside one, the rules below apply.
3. Host-only: a micro-batch runs in one fused native call (``fused_max_tokens_per_expert``,
   one precision, no fetch, no replica: the executor's ``_run_fused``) or expert by expert (the
   grouped path: gathering and combining, then each expert's product, replicas one after the other,
   a fetch or cache admission first builds its copy in host memory). Host experts on the grouped
   path run with ``host_expert_threads``; everything else with ``runtime.threads``.
4. With a device: resident experts run on the device, one after the other, at the speed
   ``expert_sm_share`` of the SMs gives (``sm_scaling``); fetched experts are copied host -> device on
   the copy engine while the resident ones compute, and computed after the last copy lands;
   host experts run on the host's threads at the same time as all of that (their activations
   cross the link both ways). A micro-batch takes the longer of the device and the host chains.
   A replicated expert's copies run at the same time on their own streams: the longer split, or all
   their weight bytes at memory bandwidth, whichever is more.
5. Copies decided at a step's end (dynamic promotions and demotions, cache prefetches) queue on the
   copy engine behind earlier ones and run during the next steps; a step takes at least as long as
   the queue it starts with (its plans may run the experts being copied). Replica copies and cache
   admissions are synchronous: they add to the step. On a host-only profile every copy takes host
   time in the step that makes it (the copier thread shares the cores).
6. Decode attention on the host (``decode_attention=host``): the step's q/k/v cross to the host and
   the outputs back per layer; prompt chunks attend on the device after their KV crosses back.

7. Expert parallelism (``parallel.ep_size`` = N ranks, one device each; the live scheme of
   :mod:`engine.parallel.ep`): dense products, attention, the lm head and the overheads run on
   every rank at once on every token (replicated), so they are priced once. Each MoE layer: every
   rank computes the pairs :func:`~engine.moe.policy.placement.assign_pairs` gives it (its own
   experts' products as in rule 4, a replicated expert's tokens split between its copies), then the
   ranks' partial outputs are summed by a ring all-reduce over the profile's ``interconnect``
   (:func:`~engine.sim.cost.all_reduce_s`: ``2 (N - 1)`` latencies plus each rank's
   :func:`~engine.moe.policy.placement.step_traffic` bytes over its bandwidth); the dispatch moves
   nothing. With ``ep_combine_chunks`` = 1 a layer takes the slowest rank's compute plus the
   all-reduce. With C > 1 chunks (:func:`~engine.moe.policy.placement.chunk_bounds`) each rank
   computes its chunks one after the other (each chunk a call of its own over the chunk's rows) and
   chunk c's all-reduce starts when every rank has computed chunk c and the previous chunk's
   all-reduce is done, running beside the next chunks' compute; the layer ends with the last chunk's.

The KV cache's growth by doubling and the scheduler's own work are in the fitted overheads, not
priced apart. Pure: numpy and the standard library.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from engine.config import EngineConfig
from engine.model.arch import ModelSpec
from engine.moe.policy.controller import PlanSettings, StepPlan
from engine.moe.policy.execution import CostModel
from engine.moe.policy.placement import (
    CopyIndex,
    EPStats,
    Placement,
    chunk_bounds,
    chunk_loads,
    place_experts,
    step_traffic,
)
from engine.moe.policy.plan import WHERE, LayerDecision, StepMoves
from engine.precision import FLOAT_BYTES
from engine.sequences import StepLayout
from engine.sim import cost
from engine.sim.profile import Profile

_HOST, _FETCH = WHERE.index("host"), WHERE.index("fetch")
_NONE = np.zeros(0, np.int64)

FUSED_PRECISIONS = ("bf16", "fp16", "int8")
"""Precisions the CPU engine's fused layer call reads (``engine.moe.experts.fused_moe``)."""


@dataclass
class Breakdown:
    """Seconds a run spent, by part (summed over steps; parts that overlap are counted where they ran)."""

    dense_s: float = 0.0
    attention_s: float = 0.0
    experts_fast_s: float = 0.0
    experts_host_s: float = 0.0
    copies_s: float = 0.0
    overhead_s: float = 0.0
    waits_s: float = 0.0
    ep_combine_s: float = 0.0  # expert parallelism: all-reduces not hidden behind expert compute

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


@dataclass
class _Layer:
    """Priced parts of one MoE layer of one step."""

    seconds: float = 0.0
    fast: float = 0.0
    host: float = 0.0
    copies: float = 0.0
    queued: float = 0.0  # background copies to the copy engine's queue
    combine: float = 0.0  # expert parallelism: the part of the layers' time after the slowest rank's compute


class _Part(NamedTuple):
    """One micro-batch of one layer as the pricer reads it: the runs in expert order (``experts``,
    ``tokens``, ``where`` an index into :data:`WHERE`), replicated runs' ``splits``, the experts the
    cache admitted for it, and its token rows."""

    experts: np.ndarray
    tokens: np.ndarray
    where: np.ndarray
    splits: tuple[tuple[int, tuple[int, ...]], ...]
    n_admitted: int
    rows: int
    where_of: np.ndarray | None = None
    """Every expert's ``where`` (-1 not routed), indexed by expert id, where the part has it at hand."""

    def where_of_split(self, expert: int) -> int:
        """``where`` of a replicated run's expert."""
        if self.where_of is not None:
            return int(self.where_of[expert])
        return int(self.where[np.searchsorted(self.experts, expert)])


@dataclass
class StepPricer:
    """Prices steps of one config on one profile (see the module docstring).

    ``loaded``: precision the weights are kept in (dense products read it; host copies of experts are
    in it); ``compute``: the activations' precision; ``native``: the CPU engine's native kernels run
    (fp32 products of half-precision weights as stored); ``hybrid``: the hybrid expert executor runs
    (a config that departs from the plain one).
    """

    profile: Profile
    spec: ModelSpec
    config: EngineConfig
    settings: PlanSettings
    loaded: str
    compute: str
    hi: str
    lo: str | None
    native: bool
    hybrid: bool
    breakdown: Breakdown = field(default_factory=Breakdown)
    backlog_s: float = 0.0
    placement: Placement | None = None
    """Expert parallelism (``parallel.ep_size`` > 1): which rank holds which experts (rule 7)."""

    def __post_init__(self) -> None:
        p, spec, cfg = self.profile, self.spec, self.config
        self.two_tier = p.device is not None
        self.fast = p.fast
        self.host = p.host
        rt, x = cfg.runtime, cfg.execution
        self.group = cfg.experts.int4_group_size
        self.k_run = max(spec.top_k, cfg.routing.top_k_override)
        self.n_layers = spec.n_layers
        self.n_moe = len(spec.moe_layers)
        self.n_dense = spec.n_layers - self.n_moe
        t_max = max(cfg.scheduler.max_batch_tokens, 1)
        self.t_max = t_max
        self.slots_max = t_max * self.k_run
        h, e = spec.hidden_size, spec.n_experts
        f = self.fast
        # Speeds: a host-only profile runs everything with runtime.threads; host experts on the grouped
        # path with host_expert_threads; with a device, its experts at the SM share's speed.
        self.fast_speed = 1.0 if self.two_tier else cost.thread_speed(self.host, rt.threads)
        self.host_threads = x.host_expert_threads or rt.threads
        self.host_speed = cost.thread_speed(self.host, self.host_threads)
        self.expert_speed = cost.sm_speed(f, x.expert_sm_share) if self.two_tier else self.fast_speed
        # Dense products of one decoder layer, the router, dense MLP layers, a shared expert, the lm head.
        c = self.compute
        # runtime.dense_precision=int8: the dense matrices and the lm head read int8 copies (a CPU engine's)
        w = "int8" if cfg.runtime.dense_precision == "int8" and self.native else self.loaded
        mm = lambda n, k, prec=w: cost.matmul_lut(f, n, k, prec, c, t_max)  # noqa: E731
        self.dense_lut = (mm(spec.q_size + 2 * spec.kv_size, h) + mm(h, spec.q_size)) / self.fast_speed
        self.router_lut = mm(e, h, c) / self.fast_speed  # the router is kept in the compute precision
        self.mlp_lut = ((mm(2 * spec.dense_intermediate, h) + mm(h, spec.dense_intermediate)) / self.fast_speed
                        if self.n_dense else np.zeros(t_max + 1))
        s = spec.shared_expert_intermediate
        self.shared_lut = (mm(2 * s, h) + mm(h, s) + mm(1, h, c)) / self.fast_speed if s else np.zeros(t_max + 1)
        self.lm_lut = cost.matmul_lut(f, spec.vocab_size, h, w, c, min(cfg.scheduler.max_batch_seqs, t_max)) \
            / self.fast_speed
        self._experts: dict[tuple[str, str, bool], np.ndarray] = {}
        self._lut_lists: dict[tuple[str, str], list[float]] = {}
        fused_ok = self.native and not self.two_tier and self.host.fused_max_tokens_per_expert > 0
        self.fused_slots = self.host.fused_max_tokens_per_expert * e if fused_ok else -1
        self.fused_call = (cost.moe_call_lut(f, h, c, t_max, fused=True) / self.fast_speed).tolist()
        self.grouped_call = (cost.moe_call_lut(f, h, c, self.slots_max, fused=False)
                             / (1.0 if self.two_tier else self.fast_speed)).tolist()
        st = self.settings
        i = spec.expert_intermediate
        # Building an expert's copy: within host memory (host-only), or across the link.
        self.bytes_hi, self.bytes_lo, self.bytes_host = st.bytes_hi, st.bytes_lo or 0, st.bytes_host
        if self.two_tier:
            link = p.link
            assert link is not None
            quant = {prec: (cost.build_copy_s(self.host, h, i, prec, st.bytes_host, self.group)
                            if prec not in FLOAT_BYTES else 0.0) for prec in {self.hi, self.lo or self.hi}}
            # A float copy crosses the link in the loaded precision; an integer one is quantised on the host first.
            self.copy_hi = quant[self.hi] + cost.transfer_s(link, st.bytes_host if self.hi in FLOAT_BYTES
                                                            else st.bytes_hi)
            self.copy_lo = (quant[self.lo] + cost.transfer_s(link, st.bytes_host if self.lo in FLOAT_BYTES
                                                             else self.bytes_lo)) if self.lo else 0.0
            act = FLOAT_BYTES.get(c, 4) * h
            self.act_d2h = lambda n: cost.transfer_s(link, n * act, "d2h")  # noqa: E731
            self.act_h2d = lambda n: cost.transfer_s(link, n * act, "h2d")  # noqa: E731
        else:
            self.copy_hi = cost.build_copy_s(f, h, i, self.hi, st.bytes_host, self.group) / self.fast_speed
            self.copy_lo = (cost.build_copy_s(f, h, i, self.lo, st.bytes_host, self.group) / self.fast_speed
                            if self.lo else 0.0)
        self.host_prec = self.loaded
        self.plain_prec = self.hi if self.hybrid else self.loaded
        self.precision_of = {"hi": self.hi, "lo": self.lo or self.hi, "host": self.loaded, "fetch": self.hi}
        self.step_fixed = f.step_overhead_s
        self.layer_fixed = f.layer_overhead_s * self.n_layers + (f.moe_layer_overhead_s * self.n_moe if self.hybrid
                                                                 else 0.0)
        self.attention_on_host = self.two_tier and x.decode_attention == "host"
        self.ep_stats: EPStats | None = None
        if self.placement is not None:
            pl, inter = self.placement, p.interconnect
            if pl.n_ranks > p.devices or inter is None or not self.two_tier:
                raise ValueError(f"profile {p.name}: {p.devices} device(s) cannot run {pl.n_ranks} ranks")
            self.ep_ranks, self.inter, self.ep_copies = pl.n_ranks, inter, CopyIndex.of(pl)
            self.act_bytes = FLOAT_BYTES.get(c, 4)
            self.ep_stats = EPStats(pl.n_ranks, self.n_moe, h, self.act_bytes)

    # ------------------------------------------------------------------------------------- tables
    def _lut(self, side: str, precision: str, fused: bool = False) -> np.ndarray:
        """Seconds of one expert on ``side`` ("fast" or "host") in ``precision`` for 0..slots_max tokens,
        at the speed that side runs experts with this config."""
        key = (side, precision, fused)
        if key not in self._experts:
            proc = self.fast if side == "fast" else self.host
            arr = cost.expert_lut(proc, self.spec.hidden_size, self.spec.expert_intermediate, precision, self.compute,
                                  self.slots_max, fused=fused, group=self.group,
                                  native=self.native or side == "fast" and self.two_tier)
            speed = self.expert_speed if side == "fast" else self.host_speed
            if not self.two_tier and fused:
                speed = self.fast_speed  # the fused call runs on every runtime thread
            self._experts[key] = arr / speed
        return self._experts[key]

    def _lut_list(self, side: str, precision: str) -> list[float]:
        """:meth:`_lut` as a list (the same values), for lookups one token count at a time."""
        key = (side, precision)
        got = self._lut_lists.get(key)
        if got is None:
            got = self._lut_lists[key] = self._lut(side, precision).tolist()
        return got

    # ----------------------------------------------------------------------------------- one step
    def price(self, layout: StepLayout, decisions: Sequence[LayerDecision], moves: StepMoves | None,
              counts: np.ndarray | None = None, ids: np.ndarray | None = None) -> float:
        """Seconds of one step (and its share of the breakdown); ``counts``: the step's routed tokens
        per expert ``[L, E]`` (read when every plan is trivial); ``ids``: its routed experts
        ``[T, L, K]`` (-1 = pruned; read under expert parallelism with a chunked combine)."""
        b = self.breakdown
        t = layout.n_tokens
        sampled = len(layout.sampled)
        dense = (self.n_layers * self.dense_lut[t] + self.n_moe * (self.router_lut[t] + self.shared_lut[t])
                 + self.n_dense * self.mlp_lut[t] + self.lm_lut[min(sampled, len(self.lm_lut) - 1)])
        attention, att_copies = self._attention(layout)
        lay = _Layer()
        if self.ep_stats is not None:  # every expert resident on its rank: plain plans (rule 7)
            if counts is None:
                counts = np.stack([d.counts for d in decisions])
            self._ep_step(t, counts, ids, lay)
        elif self._all_trivial(decisions):
            if counts is None:
                counts = np.stack([d.counts for d in decisions])
            self._trivial_step(t, counts, lay)
        elif self.two_tier and isinstance(decisions, StepPlan) and not decisions.splits:
            self._step_plan(decisions, lay)
        elif isinstance(decisions, StepPlan) and self.two_tier:  # layer by layer (replicas), from the arrays
            self._plan_two_tier(decisions, lay)
        elif isinstance(decisions, StepPlan):  # host-only: likewise, part by part (no prefetch in a plan)
            for part in self._plan_parts(decisions):
                self._part_host_only(part, lay)
        else:
            for d in decisions:
                if self.two_tier:
                    self._layer(d, lay)
                else:
                    self._layer_host_only(d, lay)
        move_s, move_queued = self._moves(moves) if moves is not None else (0.0, 0.0)
        overhead = self.step_fixed + self.fast.token_overhead_s * t + self.layer_fixed
        total = float(dense + attention + att_copies + lay.seconds + move_s + overhead)
        wait = 0.0
        if self.backlog_s > total:  # the plans of this step may run experts still being copied
            wait = self.backlog_s - total
            total = self.backlog_s
        self.backlog_s = max(0.0, self.backlog_s - total) + lay.queued + move_queued
        b.dense_s += float(dense)
        b.attention_s += attention
        b.experts_fast_s += lay.fast
        b.experts_host_s += lay.host
        b.copies_s += lay.copies + move_s + att_copies
        b.overhead_s += overhead
        b.waits_s += wait
        b.ep_combine_s += lay.combine
        return total

    @staticmethod
    def _all_trivial(decisions: Sequence[LayerDecision]) -> bool:
        """Whether every layer's plan is trivial (a whole step's plans say so themselves: reading one
        of their layers would build its decision)."""
        trivial = getattr(decisions, "trivial", None)
        return bool(trivial) if trivial is not None else bool(decisions) and all(d.trivial for d in decisions)

    def _ep_step(self, t: int, counts: np.ndarray, ids: np.ndarray | None, out: _Layer) -> None:
        """Every MoE layer of a step under expert parallelism (rule 7); records each rank's pairs,
        the imbalance and the bytes in :attr:`ep_stats` as the live engine's rank 0 does."""
        assert self.ep_stats is not None and self.placement is not None
        idx, n, lut = self.ep_copies, self.ep_ranks, self._lut("fast", self.plain_prec)
        shares = idx.shares(counts)  # [copies] pairs each copy computes
        loads = idx.by_rank(shares).astype(np.int64)  # [L, N]
        self.ep_stats.add_step(loads, t)
        h = self.spec.hidden_size
        bounds = chunk_bounds(t, self.config.parallel.ep_combine_chunks)
        if len(bounds) == 2:
            call = self.grouped_call[min(t * self.k_run, self.slots_max)]
            compute = idx.by_rank(lut[shares]) + np.where(loads > 0, call, 0.0)  # [L, N]
            slowest = float(compute.max(axis=1).sum())
            combine = self.n_moe * cost.all_reduce_s(self.inter, step_traffic(t, h, self.act_bytes, n)[1], n)
            out.seconds += slowest + combine
            out.fast += slowest
            out.combine += combine
            return
        if ids is None:
            raise ValueError("a chunked expert-parallel combine needs the step's routed ids")
        rows = np.diff(np.asarray(bounds))
        calls = np.asarray([self.grouped_call[min(int(r) * self.k_run, self.slots_max)] for r in rows])  # [C]
        sums = np.asarray([cost.all_reduce_s(self.inter, step_traffic(int(r), h, self.act_bytes, n)[1], n)
                           for r in rows])  # [C]
        c = chunk_loads(ids, self.placement, bounds)  # [C, L, N, E]
        x = lut[c].sum(axis=3) + np.where(c.sum(axis=3) > 0, calls[:, None, None], 0.0)  # [C, L, N]
        done = np.cumsum(x, axis=0).max(axis=2)  # [C, L] every rank has computed chunk c of layer l
        end = np.zeros(self.n_moe)
        for ready, s in zip(done, sums.tolist(), strict=True):
            end = np.maximum(end, ready) + s
        slowest = float(done[-1].sum())
        out.seconds += float(end.sum())
        out.fast += slowest
        out.combine += float(end.sum()) - slowest

    def _trivial_step(self, t: int, counts: np.ndarray, out: _Layer) -> None:
        """Every MoE layer's plan trivial (all routed experts resident, one micro-batch): all layers at once."""
        prec = self.plain_prec
        n_layers = counts.shape[0]
        if self.two_tier:
            s = float(self._lut("fast", prec)[counts].sum()) + n_layers * self.grouped_call[
                min(t * self.k_run, self.slots_max)]
        else:
            slots = t * (self.k_run if self.hybrid else self.spec.top_k)
            if prec in FUSED_PRECISIONS and 0 <= slots <= self.fused_slots:
                s = float(self._lut("fast", prec, fused=True)[counts].sum()) + n_layers * self.fused_call[t]
            else:
                s = float(self._lut("fast", prec)[counts].sum()) + n_layers * self.grouped_call[
                    min(slots, self.slots_max)]
        out.seconds += s
        out.fast += s

    def _attention(self, layout: StepLayout) -> tuple[float, float]:
        """(attention seconds, their copies across the link) of one step, all layers."""
        spec = self.spec
        decode = [s for s in layout.segments if s.n_tokens == 1 and s.past_len > 0]
        prefill = [s for s in layout.segments if not (s.n_tokens == 1 and s.past_len > 0)]
        heads = (spec.n_heads, spec.n_kv_heads, spec.head_dim)
        proc = self.host if self.attention_on_host else self.fast
        speed = cost.thread_speed(self.host, self.config.runtime.threads) if self.attention_on_host \
            else self.fast_speed
        per_layer = 0.0
        if decode:
            mean_kv = sum(s.past_len + 1 for s in decode) / len(decode)
            per_layer += cost.attention_decode_s(proc, len(decode), mean_kv, *heads, self.compute,
                                                 mixed=bool(prefill)) / speed
        for s in prefill:
            per_layer += cost.attention_prefill_s(self.fast, s.n_tokens, s.past_len + s.n_tokens, *heads,
                                                  self.compute) / self.fast_speed
        copies = 0.0
        if self.attention_on_host:
            link = self.profile.link
            assert link is not None
            b = FLOAT_BYTES.get(self.compute, 4)
            t = layout.n_tokens
            # q/k/v of every token go to the host cache, outputs come back; chunks read their KV back.
            copies = (cost.transfer_s(link, t * (spec.q_size + 2 * spec.kv_size) * b, "d2h", pinned=False)
                      + cost.transfer_s(link, t * spec.q_size * b, "h2d", pinned=False)
                      + sum(cost.transfer_s(link, 2 * (s.past_len + s.n_tokens) * spec.kv_size * b, "h2d",
                                            pinned=False) for s in prefill))
        return self.n_layers * per_layer, self.n_layers * copies

    # ---------------------------------------------------------------------------- a layer's parts
    @staticmethod
    def _parts(d: LayerDecision) -> list[_Part]:
        """The micro-batches of a (non-trivial) layer decision, as :class:`_Part`."""
        return [_Part(p.arrays.experts, p.arrays.tokens, p.arrays.where, p.arrays.splits, len(p.admitted),
                      p.stop - p.start) for p in d.parts]

    @staticmethod
    def _plan_parts(d: StepPlan) -> Iterator[_Part]:
        """Each layer's one part of a step planned at once, read from its arrays (what
        :class:`~engine.moe.policy.controller.StepPlan` builds a layer decision from, without building it)."""
        admitted = d.n_admitted.tolist() if d.n_admitted is not None else [0] * len(d)
        mask = d.where >= 0
        experts = np.nonzero(mask)[1]  # routed experts, layer after layer, ascending within each
        tokens, where = d.counts[mask], d.where[mask]
        bounds = np.concatenate([[0], np.cumsum(mask.sum(1))]).tolist()
        for li in range(len(d)):
            lo, hi = bounds[li], bounds[li + 1]
            yield _Part(experts[lo:hi], tokens[lo:hi], where[lo:hi], d.splits.get(li, ()), admitted[li], d.n_tokens,
                        d.where[li])

    # ------------------------------------------------------------------------------ host-only MoE
    def _layer_host_only(self, d: LayerDecision, out: _Layer) -> None:
        if d.trivial:
            self._trivial_step(d.n_tokens, d.counts[None, :], out)
            return
        for part in self._parts(d):
            self._part_host_only(part, out)
        if d.prefetch:  # the copier thread shares the cores
            out.copies += len(d.prefetch) * self.copy_hi
            out.seconds += len(d.prefetch) * self.copy_hi

    def _part_host_only(self, a: _Part, out: _Layer) -> None:
        rows = a.rows
        slots = rows * self.k_run
        n_by = np.bincount(a.where, minlength=4)  # runs per place: hi, lo, host, fetch
        precs = {self.precision_of[w] for w, n in zip(WHERE, n_by.tolist(), strict=True) if n}
        admits = a.n_admitted * self.copy_hi
        s = self.fast.part_overhead_s + admits
        out.copies += admits
        if (0 <= slots <= self.fused_slots and len(precs) <= 1 and precs <= set(FUSED_PRECISIONS)
                and not a.splits and not n_by[3]):
            e = float(self._lut("fast", precs.pop(), fused=True)[a.tokens].sum()) if precs else 0.0
            s += self.fused_call[rows] + e
            out.fast += e
            out.seconds += s
            return
        s += self.grouped_call[min(slots, self.slots_max)]
        fast = host = 0.0
        for code, where in enumerate(WHERE):
            if not n_by[code]:
                continue
            tok = a.tokens[a.where == code]
            if where == "host":
                host += float(self._lut("host", self.host_prec)[tok].sum())
                continue
            lut = self._lut("fast", self.precision_of[where])
            fast += float(lut[tok].sum())
            if where == "fetch":
                fast += n_by[code] * self.copy_hi
                out.copies += n_by[code] * self.copy_hi
        for expert, split in a.splits:  # replicas one after the other: the splits, not the whole
            lut = self._lut_list("fast", self.precision_of[WHERE[a.where_of_split(expert)]])
            fast += sum(lut[n] for n in split) - lut[sum(split)]
        out.fast += fast
        out.host += host
        out.seconds += s + fast + host

    # ------------------------------------------------------------------------------- two-tier MoE
    def _layer(self, d: LayerDecision, out: _Layer) -> None:
        if d.trivial:
            self._trivial_step(d.n_tokens, d.counts[None, :], out)
            return
        for part in self._parts(d):
            self._part(part, out)
        out.queued += len(d.prefetch) * self.copy_hi

    def _place_lut(self, code: int) -> np.ndarray:
        """The table the runs of place ``code`` (an index into :data:`WHERE`) are priced by, two-tier."""
        if code == _HOST:
            return self._lut("host", self.host_prec)
        return self._lut("fast", self.hi if code == _FETCH else self.precision_of[WHERE[code]])

    def _part(self, a: _Part, out: _Layer) -> None:
        n_by = np.bincount(a.where, minlength=4).tolist()
        sums, host_tokens = [0.0] * len(WHERE), 0
        for code in range(len(WHERE)):
            if not n_by[code]:
                continue
            tok = a.tokens[a.where == code]
            sums[code] = float(self._place_lut(code)[tok].sum())
            if code == _HOST:
                host_tokens = int(tok.sum())
        self._combine_part(n_by, sums, host_tokens, a, out)

    def _plan_two_tier(self, d: StepPlan, out: _Layer) -> None:
        """:meth:`_part` of every layer of a step plan: each (layer, place)'s runs gathered once for the
        whole step, in expert order (a stable sort by layer and place), so each sum is the same."""
        n_layers = len(d)
        mask = d.where >= 0
        layer_of, _ = np.nonzero(mask)
        tokens, where = d.counts[mask], d.where[mask]
        key = layer_of * len(WHERE) + where  # runs by (layer, place), experts ascending within each
        order = np.argsort(key, kind="stable")
        tokens, where = tokens[order], where[order]
        seconds = np.empty(len(tokens))
        for code, n in enumerate(d.runs_by_where):
            if n:
                at = where == code
                seconds[at] = self._place_lut(code)[tokens[at]]
        n_by = np.bincount(key, minlength=n_layers * len(WHERE)).reshape(n_layers, len(WHERE)).tolist()
        bounds = np.concatenate([[0], np.cumsum(n_by)]).tolist()  # start of each (layer, place)'s runs
        admitted = d.n_admitted.tolist() if d.n_admitted is not None else [0] * n_layers
        for li in range(n_layers):
            sums, host_tokens = [0.0] * len(WHERE), 0
            for code in range(len(WHERE)):
                if n_by[li][code]:
                    lo, hi = bounds[li * len(WHERE) + code], bounds[li * len(WHERE) + code + 1]
                    sums[code] = float(seconds[lo:hi].sum())
                    if code == _HOST:
                        host_tokens = int(tokens[lo:hi].sum())
            part = _Part(_NONE, _NONE, _NONE, d.splits.get(li, ()), admitted[li], d.n_tokens, d.where[li])
            self._combine_part(n_by[li], sums, host_tokens, part, out)

    def _combine_part(self, n_by: list[int], sums: list[float], host_tokens: int, a: _Part, out: _Layer) -> None:
        """A two-tier part from its runs per place, their seconds per place and its host tokens (rule 4)."""
        link = self.profile.link
        assert link is not None
        bw = self.fast.mem_bw_bytes_per_s * self.fast.bw_efficiency * self.expert_speed
        resident = fetched = host = 0.0
        for code in range(len(WHERE)):
            if not n_by[code]:
                continue
            if code == _HOST:
                host += sums[code]
                host += self.act_d2h(host_tokens) + self.act_h2d(host_tokens)
            elif code == _FETCH:
                fetched += sums[code]
            else:
                resident += sums[code]
        for expert, split in a.splits:  # copies on their own streams, sharing the memory bandwidth
            where = WHERE[a.where_of_split(expert)]
            lut = self._lut_list("fast", self.precision_of[where])
            nbytes = (self.bytes_hi if where == "hi" else self.bytes_lo) * len(split)
            resident += max(max(lut[n] for n in split), nbytes / bw) - lut[sum(split)]
        fetch_copy = n_by[_FETCH] * self.copy_hi
        copies_done = self.backlog_s + fetch_copy if fetch_copy else 0.0
        device = max(resident, copies_done) + fetched + (1.0 - link.overlap) * min(resident, fetch_copy)
        admits = a.n_admitted * self.copy_hi  # synchronous: the part waits for them
        out.seconds += self.fast.part_overhead_s + admits + max(device, host) + self.grouped_call[
            min(a.rows * self.k_run, self.slots_max)]
        out.fast += resident + fetched
        out.host += host
        out.copies += fetch_copy + admits

    def _step_plan(self, d: StepPlan, out: _Layer) -> None:
        """:meth:`_layer` of every layer of a step planned at once (one micro-batch, a cache without
        prefetch or none, no replicas), as arrays over layers: the same sums, the same overlap rules."""
        counts, where = d.counts, d.where
        link = self.profile.link
        assert link is not None
        # Places without a run this step add exact zeros to every sum below: they are skipped.
        n_hi, n_lo, n_host, n_fetch = d.runs_by_where
        zeros = np.zeros(counts.shape[0])
        hi_tokens = self._lut("fast", self.hi)[counts] if n_hi or n_fetch else None  # [L, E]
        resident = (hi_tokens * (where == 0)).sum(1) if n_hi else zeros  # [L]
        if n_lo:
            resident = resident + (self._lut("fast", self.precision_of["lo"])[counts] * (where == 1)).sum(1)
        host = zeros
        if n_host:
            is_host = where == 2
            host_tokens = (counts * is_host).sum(1)
            act = FLOAT_BYTES.get(self.compute, 4) * self.spec.hidden_size * host_tokens
            crossing = np.where(host_tokens > 0, 2 * link.latency_s + act / link.d2h_pinned_bytes_per_s
                                + act / link.h2d_pinned_bytes_per_s, 0.0)
            host = (self._lut("host", self.host_prec)[counts] * is_host).sum(1) + crossing
        fetch_copy_s = 0.0
        if n_fetch:
            is_fetch = where == 3
            fetched = (hi_tokens * is_fetch).sum(1)
            fetch_copy = is_fetch.sum(1) * self.copy_hi
            copies_done = np.where(fetch_copy > 0, self.backlog_s + fetch_copy, 0.0)
            device = np.maximum(resident, copies_done) + fetched + (1.0 - link.overlap) * np.minimum(resident,
                                                                                                     fetch_copy)
            fast = resident + fetched
            fetch_copy_s = fetch_copy.sum()
        else:
            device = fast = resident
        call = self.grouped_call[min(d.n_tokens * self.k_run, self.slots_max)]
        admits = d.n_admitted * self.copy_hi if d.n_admitted is not None else 0.0  # synchronous, as in _layer
        out.seconds += float((self.fast.part_overhead_s + admits + (np.maximum(device, host) if n_host else device)
                              + call).sum())
        out.fast += float(fast.sum())
        out.host += float(host.sum())
        out.copies += float(fetch_copy_s + np.sum(admits))

    # ------------------------------------------------------------------------------------- moves
    def _moves(self, moves: StepMoves) -> tuple[float, float]:
        """(seconds the step takes for its moves, seconds queued on the copy engine)."""
        if moves.empty:
            return 0.0, 0.0
        copies = 0.0
        for m in (*moves.demotions, *moves.promotions):
            if m.dst == "hi":
                copies += self.copy_hi
            elif m.dst == "lo":
                copies += self.copy_lo
        replicas = sum(c.replicas for c in moves.replicas) * self.copy_hi  # built when applied: synchronous
        if self.two_tier:
            return replicas, copies
        return replicas + copies, 0.0

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in self.breakdown.as_dict().items() if math.isfinite(v)}


def decision_costs(pricer: StepPricer) -> CostModel:
    """The costs ``missing_expert="auto"`` decides by on this profile: host and fast-tier compute of one
    expert at 1, 8 and 32 tokens as the pricer prices them, and the copy of one expert, as a
    :class:`~engine.moe.policy.execution.CostModel` (what the live engine calibrates on its machine)."""
    from engine.moe.policy.execution import LinkCost, fit_compute_cost

    nbytes = pricer.bytes_host
    grid = [n for n in (1, 8, 32) if n <= pricer.slots_max] or [1]
    host = pricer._lut("host", pricer.host_prec)
    fast = pricer._lut("fast", pricer.hi)
    samples_host = [(n, nbytes, host[n]) for n in grid] + [(0, nbytes, 0.0)]
    samples_fast = [(n, nbytes, fast[n]) for n in grid] + [(0, nbytes, 0.0)]
    copy_s = max(pricer.copy_hi, 1e-12)
    key = pricer.loaded
    return CostModel(host={key: fit_compute_cost(samples_host)}, device={key: fit_compute_cost(samples_fast)},
                     link=LinkCost(nbytes / copy_s, 0.0), default_precision=key)


def memory_need(spec: ModelSpec, config: EngineConfig, settings: PlanSettings, loaded: str, compute: str,
                profile: Profile) -> str | None:
    """Why ``config`` does not fit the profile's memories (one line), or None: the fast tier holds the
    dense weights (and their int8 copies under ``runtime.dense_precision=int8``), the resident experts (all
    of them under ``residency=all``, else the budget) and
    replicas, the KV cache at full size (``max_batch_seqs`` x ``max_seq_len_tokens``, unless decode
    attention keeps it on the host); with a device, the host holds every expert's host copy. Under
    expert parallelism (``parallel.ep_size`` = N, at most the profile's ``devices``) each device holds
    the dense weights, the KV cache and its rank's expert copies (the placement's slots, which its
    capacities fix whatever the hotness; the fullest rank counts)."""
    s, r, x, par = config.scheduler, config.experts, config.execution, config.parallel
    if par.ep_size > profile.devices:
        return (f"parallel.ep_size={par.ep_size} exceeds profile {profile.name}'s devices={profile.devices} "
                "(one device per rank)")
    wb = FLOAT_BYTES.get(loaded, 4)
    n_experts = spec.n_experts * len(spec.moe_layers)
    dense_bytes = (spec.total_params() - spec.expert_params() * n_experts) * wb
    if config.runtime.dense_precision == "int8":  # int8 copies beside the weights as loaded (kept for switching back)
        dense_bytes += spec.int8_dense_bytes()
    if par.ep_size > 1:  # the experts (copies) this device holds
        n_moe = len(spec.moe_layers)
        pl = place_experts(par.ep_placement, par.ep_size, spec.n_experts, n_moe, None, par.redundant_experts)
        n_experts = max(sum(pl.slots(li)[rank] for li in range(n_moe)) for rank in range(par.ep_size))
    loaded_experts = settings.bytes_host * n_experts  # the experts as loaded
    kv = spec.kv_bytes_per_token(FLOAT_BYTES.get(compute, 4)) * s.max_batch_seqs * s.max_seq_len_tokens
    two_tier = profile.device is not None
    kv_on_fast = not (two_tier and x.decode_attention == "host")
    # Fast-tier copies besides the loaded weights: every expert in hi (unless those are the loaded
    # weights), else the budget; replicas take budget beside all-resident experts.
    if r.residency == "all":
        copies = (0 if settings.resident_as_loaded else settings.bytes_hi * n_experts) \
            + (settings.budget_bytes if x.max_replicas else 0)
    else:
        copies = min(settings.budget_bytes, settings.bytes_hi * n_experts)
    acts = s.max_batch_tokens * (16 * spec.hidden_size + 3 * spec.top_k * spec.expert_intermediate) * 4
    # The loaded experts sit on the fast tier on a host-only profile, or with a device under residency=all.
    on_fast = loaded_experts if (not two_tier or r.residency == "all") else 0
    fast_need = dense_bytes + on_fast + copies + (kv if kv_on_fast else 0) + acts
    fast = profile.fast
    gib = 2**30
    if fast_need > fast.mem_bytes:
        where = fast.name if par.ep_size == 1 else f"each of {par.ep_size} {fast.name} (one rank's share)"
        return (f"the config needs {fast_need / gib:.1f} GiB on {where} (dense weights {dense_bytes / gib:.1f}, "
                f"experts {(on_fast + copies) / gib:.1f}, KV cache {kv / gib if kv_on_fast else 0:.1f}) of its "
                f"{fast.mem_bytes / gib:.1f} GiB")
    if two_tier:
        host_need = (loaded_experts if r.residency != "all" else 0) + (0 if kv_on_fast else kv)
        if host_need > profile.host.mem_bytes:
            return (f"the config needs {host_need / gib:.1f} GiB of host memory on {profile.host.name} (host copies "
                    f"of the experts, KV cache) of its {profile.host.mem_bytes / gib:.1f} GiB")
    return None
