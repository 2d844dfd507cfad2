"""The expert store and the hybrid expert executor: the mechanism behind the residency knobs.

Every expert has a stable :class:`ExpertHandle`. Its ``host`` version (the slow tier) always exists;
``fast`` is the copy resident on the fast tier (high or low precision), or None. Promotions are built
off to the side (on a background thread, on their own CUDA stream where there is one) and swapped in
by one attribute assignment, so a forward pass that read a handle always runs a complete version.

:class:`HybridExperts` runs one MoE layer's experts for a step: each expert with tokens runs on its
fast copy when resident, else on the host CPU or after a fetch (``execution.missing_expert``), its
tokens split across replicas where it has them, coalesced or in micro-batches. Decisions come from
:mod:`engine.moe.policy`, which holds no device code.

Without an accelerator both tiers are host memory: the same code runs (and is tested), but the
timing effects of tiers are not a GPU box's; results say ``hybrid: false``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from engine import kernels
from engine.config import EngineConfig
from engine.model.arch import ModelSpec
from engine.moe.policy import (
    CostModel,
    DynamicResidency,
    ExpertCache,
    ResidencyPlan,
    decide,
    layer_budgets,
    plan_replicas,
    plan_static,
    split_slices,
    step_slices,
)

log = logging.getLogger(__name__)

_FLOAT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_of(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


@dataclass(frozen=True)
class ExpertVersion:
    """One complete copy of an expert's weights: gate+up [2I, H] and down [H, I], in one precision."""

    w13: Any  # torch.Tensor for float precisions, quant.QWeight otherwise
    w2: Any
    precision: str
    device: torch.device
    nbytes: int

    def linear13(self, x: torch.Tensor, native: bool = False) -> torch.Tensor:
        return _product(x, self.w13, native)

    def linear2(self, x: torch.Tensor, native: bool = False) -> torch.Tensor:
        return _product(x, self.w2, native)


def _product(x: torch.Tensor, w: Any, native: bool) -> torch.Tensor:
    """``x @ w.T`` for a float tensor or a quant.QWeight; ``native`` allows moetune's CPU kernels."""
    if isinstance(w, torch.Tensor):
        return kernels.linear(x, w)
    y = kernels.linear_q(x, w) if native and x.dtype == torch.float32 and w.device.type == "cpu" else None
    return _quant().qlinear(x, w) if y is None else y  # None: PyTorch's path is the faster one here


def _record_stream(v: ExpertVersion, stream: torch.cuda.Stream) -> None:
    """Tell the CUDA caching allocator that ``stream`` uses the version's memory too."""
    for w in (v.w13, v.w2):
        for t in ((w,) if isinstance(w, torch.Tensor) else (w.data, w.scales)):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(stream)


@contextmanager
def _null() -> Iterator[None]:
    yield


def _quant():
    from engine.moe import quant  # integer precisions only: float versions never need it

    return quant


def expert_nbytes(hidden: int, inter: int, precision: str, group_size: int) -> int:
    """Exact bytes of one expert (gate+up [2I, H] and down [H, I]) in ``precision``."""
    if precision in _FLOAT:
        return 3 * hidden * inter * torch.finfo(_FLOAT[precision]).bits // 8
    return _quant().expert_nbytes(hidden, inter, precision, group_size)


def make_version(w13: torch.Tensor, w2: torch.Tensor, precision: str, device: torch.device, group_size: int,
                 pin: bool = False, non_blocking: bool = False, native: bool = False) -> ExpertVersion:
    """Build a version of an expert in ``precision`` on ``device`` from float weights (``native``: int4 in
    the layout of moetune's CPU kernels)."""
    if precision in _FLOAT:
        a = w13.to(device=device, dtype=_FLOAT[precision], copy=True, non_blocking=non_blocking)
        b = w2.to(device=device, dtype=_FLOAT[precision], copy=True, non_blocking=non_blocking)
        if pin and device.type == "cpu" and torch.cuda.is_available():
            a, b = a.pin_memory(), b.pin_memory()
        return ExpertVersion(a, b, precision, device, a.numel() * a.element_size() + b.numel() * b.element_size())
    quant = _quant()
    qa = quant.quantize(w13.float(), precision, group_size=group_size, native=native).to(device)
    qb = quant.quantize(w2.float(), precision, group_size=group_size, native=native).to(device)
    return ExpertVersion(qa, qb, precision, device, qa.nbytes() + qb.nbytes())


class ExpertHandle:
    """Stable reference to an expert; ``fast`` and ``replicas`` are replaced whole, never mutated."""

    __slots__ = ("host", "fast", "replicas")

    def __init__(self, host: ExpertVersion):
        self.host = host
        self.fast: ExpertVersion | None = None
        self.replicas: tuple[ExpertVersion, ...] = ()


@dataclass
class TierStats:
    """What the tiers did during a run: bytes moved, where experts ran."""

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

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass
class HybridPlanState:
    plan: ResidencyPlan | None = None
    dynamic: DynamicResidency | None = None
    cache: ExpertCache | None = None
    replicas: dict[int, dict[int, int]] = field(default_factory=dict)


class HybridExperts:
    """Residency, precision, missing-expert execution, replicas and batching for every MoE layer."""

    def __init__(self, spec: ModelSpec, config: EngineConfig, w13: dict[int, torch.Tensor],
                 w2: dict[int, torch.Tensor], device: torch.device, compute_dtype: torch.dtype,
                 cost: CostModel | None):
        self.spec, self.config, self.device, self.dtype, self.cost = spec, config, device, compute_dtype, cost
        r = config.experts
        # The weights as loaded: the compute dtype, or bf16/fp16 that the native CPU kernels read as is.
        loaded = precision_of(next(iter(w13.values())).dtype)
        self.native = (compute_dtype == torch.float32 and config.runtime.cpu_kernels != "torch"
                       and kernels.load() is not None)
        self.hi = loaded if r.hi_precision == "auto" else r.hi_precision
        self.lo = None if r.lo_precision == "none" else r.lo_precision
        self.group = r.int4_group_size
        self.host_device = torch.device("cpu")
        self.moe_layers = list(spec.moe_layers)
        self.layer_index = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.stats = TierStats()
        self.state = HybridPlanState()
        self._lock = threading.Lock()
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetune-promote")
        self._pending: list[Future] = []
        self._host_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetune-host-experts")
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._replica_streams: list[torch.cuda.Stream] = []
        self.inert: dict[str, str] = {}
        self.expert_stream = self._sm_partition_stream()
        self.bytes_hi = expert_nbytes(spec.hidden_size, spec.expert_intermediate, self.hi, self.group)
        self.bytes_lo = (expert_nbytes(spec.hidden_size, spec.expert_intermediate, self.lo, self.group)
                         if self.lo else None)
        self.bytes_host = expert_nbytes(spec.hidden_size, spec.expert_intermediate, loaded, self.group)
        # Host versions: the weights as loaded, in host memory (pinned with a GPU). When every expert
        # stays resident in the loaded precision, the loaded weights are the fast copies.
        self.all_as_loaded = r.residency == "all" and self.hi == loaded
        self.handles: dict[int, list[ExpertHandle]] = {}
        pin = device.type == "cuda"
        for layer in self.moe_layers:
            hs = []
            for e in range(spec.n_experts):
                a, b = w13[layer][e], w2[layer][e]
                if a.device.type != "cpu" and not self.all_as_loaded:
                    a, b = a.cpu(), b.cpu()
                elif pin and a.device.type == "cpu":
                    a, b = a.pin_memory(), b.pin_memory()
                v = ExpertVersion(a, b, loaded, a.device, self.bytes_host)
                h = ExpertHandle(v)
                if self.all_as_loaded:
                    h.fast = v
                hs.append(h)
            self.handles[layer] = hs
        self._step_ids: dict[int, np.ndarray] = {}
        self._recent: list[np.ndarray] = []
        self._recent_tokens = 0

    # ------------------------------------------------------------------ planning
    def budgets(self, load: np.ndarray | None) -> np.ndarray:
        r = self.config.experts
        vector = [float(w) for w in r.budget_layer_weights.split(",")] if r.budget_split == "vector" else None
        return layer_budgets(int(r.resident_budget_gib * 2**30), r.budget_split, len(self.moe_layers),
                             load=load, vector=vector)

    def plan(self, hotness: np.ndarray | None) -> None:
        """Make the initial resident set from a hotness profile [MoE layers, E] (shares per layer)."""
        r = self.config.experts
        n_layers, n_experts = len(self.moe_layers), self.spec.n_experts
        if self.all_as_loaded:
            return
        if r.residency == "all":
            plan = ResidencyPlan(n_experts, self.bytes_hi, None, np.full(n_layers, self.bytes_hi * n_experts),
                                 tuple(tuple(range(n_experts)) for _ in range(n_layers)),
                                 tuple(() for _ in range(n_layers)))
            self._apply(plan)
            return
        if hotness is None:
            hotness = np.full((n_layers, n_experts), 1.0 / n_experts)
        budgets = self.budgets(hotness.sum(axis=1))
        if r.residency == "cache":
            self.state.cache = ExpertCache.from_budgets(n_experts, budgets, self.bytes_hi, policy=r.cache_policy)
            plan = ResidencyPlan(n_experts, self.bytes_hi, None, budgets, tuple(() for _ in range(n_layers)),
                                 tuple(() for _ in range(n_layers)))
            self._apply(plan)
            return
        if r.residency == "dynamic":
            self.state.dynamic = DynamicResidency.from_hotness(
                hotness, budgets, self.bytes_hi, self.bytes_lo, half_life_tokens=r.dynamic_halflife_tokens,
                replan_interval_tokens=r.dynamic_replan_tokens, hysteresis=r.dynamic_hysteresis,
                max_swaps_per_replan=max(1, n_experts // 8))
            self._apply(self.state.dynamic.plan)
            return
        self._apply(plan_static(hotness, budgets, self.bytes_hi, self.bytes_lo))

    def _version(self, layer: int, expert: int, precision: str) -> ExpertVersion:
        host = self.handles[layer][expert].host
        if self.copy_stream is not None:
            with torch.cuda.stream(self.copy_stream):
                v = make_version(host.w13, host.w2, precision, self.device, self.group)
            self.copy_stream.synchronize()
            return v
        return make_version(host.w13, host.w2, precision, self.device, self.group, native=self.native)

    def _apply(self, plan: ResidencyPlan) -> None:
        """Make the fast tier match ``plan`` now (start-up)."""
        for li, layer in enumerate(self.moe_layers):
            for e, h in enumerate(self.handles[layer]):
                tier = plan.tier(li, e)
                want = {"hi": self.hi, "lo": self.lo, "host": None}[tier]
                if want is None:
                    if h.fast is not None:
                        self.stats.bytes_evicted += h.fast.nbytes
                    h.fast = None
                elif h.fast is None or h.fast.precision != want:
                    h.fast = self._version(layer, e, want)
                    self.stats.bytes_to_fast += h.fast.nbytes
        self.state.plan = plan

    def _promote_async(self, moves: list[tuple[int, int, str | None]]) -> None:
        """Copy promotions in the background and swap each handle when its copy is complete."""

        def work() -> None:
            for layer, e, precision in moves:
                h = self.handles[layer][e]
                if precision is None:
                    old = h.fast
                    h.fast = None  # demotion: the next forward pass uses the host version
                    if old is not None:
                        with self._lock:
                            self.stats.bytes_evicted += old.nbytes
                    continue
                v = self._version(layer, e, precision)
                h.fast = v  # one assignment: readers see the old or the new complete version
                with self._lock:
                    self.stats.bytes_to_fast += v.nbytes
                    self.stats.swaps += 1

        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._copier.submit(work))

    def drain(self) -> None:
        """Wait for background promotions (end of run, tests)."""
        for f in self._pending:
            f.result()
        self._pending = []

    def observe(self, counts: np.ndarray, tokens: int) -> None:
        """After a step: per-MoE-layer routed counts [L, E] feed dynamic residency and replica planning."""
        st = self.state
        if st.dynamic is not None:
            res = st.dynamic.update(counts, tokens)
            if res is not None:
                self.stats.replans += 1
                moves: list[tuple[int, int, str | None]] = []
                for li, layer_moves in enumerate(res.demotions):
                    moves += [(self.moe_layers[li], m.expert, None if m.dst == "host" else
                               (self.hi if m.dst == "hi" else self.lo)) for m in layer_moves]
                for li, layer_moves in enumerate(res.promotions):
                    moves += [(self.moe_layers[li], m.expert, self.hi if m.dst == "hi" else self.lo)
                              for m in layer_moves]
                if moves:
                    self._promote_async(moves)
                st.plan = res.plan
        x = self.config.execution
        if x.max_replicas > 0:
            self._recent.append(counts)
            self._recent_tokens += tokens
            if self._recent_tokens >= x.replica_window_tokens:
                self._replan_replicas(np.sum(self._recent, axis=0))
                self._recent, self._recent_tokens = [], 0

    def _replan_replicas(self, recent: np.ndarray) -> None:
        x = self.config.execution
        plan = self.state.plan
        used = plan.bytes_used() if plan is not None else np.zeros(len(self.moe_layers))
        spare = np.maximum(0, self.budgets(None) - used) if self.config.experts.residency != "all" else \
            np.full(len(self.moe_layers), int(self.config.experts.resident_budget_gib * 2**30))
        wanted = plan_replicas(recent, x.replica_threshold, x.max_replicas, spare, self.bytes_hi)
        for li, layer in enumerate(self.moe_layers):
            for e, h in enumerate(self.handles[layer]):
                n = wanted.get(li, {}).get(e, 0)
                if n != len(h.replicas):
                    h.replicas = tuple(self._version(layer, e, self.hi) for _ in range(n))
                    self.stats.bytes_to_fast += n * self.bytes_hi
        self.state.replicas = wanted

    def _sm_partition_stream(self) -> torch.cuda.Stream | None:
        """A stream on a CUDA green context holding ``expert_sm_share`` of the SMs, for expert compute.

        Green contexts (CUDA 12.4+ driver API, exposed as ``torch.cuda.green_contexts``) give a real SM
        partition; transfers and attention stay on the default context's streams. Where they are not
        available the knob is reported inert with the reason.
        """
        share = self.config.execution.expert_sm_share
        if self.device.type != "cuda" or share >= 1.0:
            return None
        try:
            from torch.cuda.green_contexts import SUPPORTED, GreenContext
        except ImportError:
            SUPPORTED = False
        if not SUPPORTED:
            self.inert["execution.expert_sm_share"] = "this PyTorch build has no CUDA green contexts"
            return None
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        n = max(1, int(round(share * sms)))
        try:
            self._green = GreenContext.create(num_sms=n, device_id=self.device.index or 0)
            stream = self._green.Stream()
        except Exception as e:  # driver too old, MIG, ...: say so rather than ignore the knob
            self.inert["execution.expert_sm_share"] = f"green context with {n} SMs failed: {e}"
            return None
        log.info("expert compute on a green context of %d of %d SMs", n, sms)
        return stream

    # ------------------------------------------------------------------ execution
    @contextmanager
    def _host_threads(self) -> Iterator[None]:
        n = self.config.execution.host_expert_threads
        if not n:
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _run(self, v: ExpertVersion, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU expert on version ``v``; x on v's device in the compute dtype."""
        want = _FLOAT.get(v.precision)
        if want is None or want == x.dtype or (self.native and v.device.type == "cpu" and want in kernels.HALF_DTYPES):
            xin = x  # same dtype, integer weights, or fp32 products read straight from half weights
        else:
            xin = x.to(want)  # a float copy in another precision
        gu = v.linear13(xin, self.native)  # [n, 2I]
        inter = gu.shape[-1] // 2
        return v.linear2(F.silu(gu[:, :inter]) * gu[:, inter:], self.native).to(x.dtype)  # [n, H]

    def forward(self, layer: int, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Experts of one MoE layer for a step. h [T, H]; weights/ids [T, K] (id -1 = skipped slot)."""
        x_cfg = self.config.execution
        t, k = ids.shape
        out = torch.zeros_like(h)
        stream = self.expert_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else _null():
            for sl in step_slices(t, x_cfg.expert_batching, x_cfg.micro_batch_tokens):
                out[sl] = self._forward_tokens(layer, h[sl], weights[sl], ids[sl])
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.state.cache is not None and self.config.experts.prefetch_experts > 0:
            self._prefetch_next(layer, ids)
        return out

    def _prefetch_next(self, layer: int, ids: torch.Tensor) -> None:
        """Cache residency: learn layer-to-layer co-occurrence and copy up the next layer's likely experts."""
        cache = self.state.cache
        li = self.layer_index[layer]
        self._step_ids[li] = ids.cpu().numpy()
        if li == len(self.moe_layers) - 1:
            if len(self._step_ids) == len(self.moe_layers):
                cache.observe(np.stack([self._step_ids[i] for i in range(len(self.moe_layers))], axis=1))
            self._step_ids = {}
            return
        flat = self._step_ids[li].reshape(-1)
        current = {int(e): int(n) for e, n in zip(*np.unique(flat[flat >= 0], return_counts=True), strict=True)}
        want = cache.prefetch_candidates(li + 1, current, self.config.experts.prefetch_experts)
        if not want:
            return
        nxt = self.moe_layers[li + 1]
        moves: list[tuple[int, int, str | None]] = [(nxt, e, None) for e in cache.prefetch(li + 1, want)]
        moves += [(nxt, e, self.hi) for e in want if e in cache.cached(li + 1)]
        self.stats.prefetched += len(want)
        self._promote_async(moves)

    def _run_fused(self, layer: int, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        """Every routed expert in one native call when all are resident on the host in one precision
        (bf16/fp16, int8 with row scales, int4 in the native layout) without replicas and the measured
        path for this many tokens per expert is native; None when the general path must run."""
        if not self.native or h.device.type != "cpu" or self.state.cache is not None:
            return None
        hs = self.handles[layer]
        routed: dict[int, int] = {}
        for e in ids.reshape(-1).tolist():
            if e >= 0:
                routed[e] = routed.get(e, 0) + 1
        versions, on_host = {}, 0
        for e, n_tok in routed.items():
            v = hs[e].fast
            if v is None and self.device.type == "cpu" and decide(
                    n_tok, self.bytes_host, self.config.execution.missing_expert, self.cost) == "host":
                v, on_host = hs[e].host, on_host + 1  # without an accelerator the host copy is the same memory
            if v is None or hs[e].replicas or v.device.type != "cpu":
                return None
            versions[e] = v
        precisions = {v.precision for v in versions.values()}
        if (len(precisions) != 1 or not precisions <= {"bf16", "fp16", "int8", "int4"}
                or not kernels.fused_moe(next(iter(precisions)), ids.numel() / self.spec.n_experts)
                or any(v.precision == "int4" and v.w13.layout != "int4_native" for v in versions.values())):
            return None
        n = self.spec.n_experts
        resident = [v for e, v in versions.items() if v is hs[e].fast]
        self.stats.expert_calls_host += on_host
        self.stats.expert_calls_fast_hi += sum(1 for v in resident if v.precision == self.hi)
        self.stats.expert_calls_fast_lo += sum(1 for v in resident if v.precision != self.hi)
        return kernels.moe_experts(h, [versions[e].w13 if e in versions else None for e in range(n)],
                                   [versions[e].w2 if e in versions else None for e in range(n)], ids, weights)

    def _forward_tokens(self, layer: int, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t, k = ids.shape
        fused = self._run_fused(layer, h, weights, ids)
        if fused is not None:
            return fused
        flat = ids.reshape(-1)
        valid = flat >= 0
        order = torch.argsort(torch.where(valid, flat, self.spec.n_experts), stable=True)
        n_valid = int(valid.sum())
        order = order[:n_valid]
        counts = torch.bincount(flat[valid], minlength=self.spec.n_experts).tolist()
        xs = h.index_select(0, order // k)  # [N, H] grouped by expert
        ys = torch.empty_like(xs)
        li = self.layer_index[layer]
        cache = self.state.cache
        host_jobs: list[tuple[int, int, Future]] = []
        fetches: list[tuple[slice, ExpertVersion]] = []
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            seg = slice(start, start + n)
            start += n
            handle = self.handles[layer][e]
            if cache is not None:
                acc = cache.access(li, [e])
                for ev in acc.evictions:
                    old = self.handles[layer][ev].fast
                    self.handles[layer][ev].fast = None
                    if old is not None:
                        self.stats.bytes_evicted += old.nbytes
                if handle.fast is None and e in cache.cached(li):  # admitted on a miss: copy it up, keep it
                    handle.fast = self._version(layer, e, self.hi)
                    self.stats.bytes_to_fast += handle.fast.nbytes
                # not admitted (a cache smaller than one expert): it runs as a missing expert below
            v = handle.fast  # read once: a concurrent swap cannot split this call across versions
            if v is not None:
                if v.precision == self.hi:
                    self.stats.expert_calls_fast_hi += 1
                else:
                    self.stats.expert_calls_fast_lo += 1
                copies = (v, *handle.replicas)
                if len(copies) == 1:
                    ys[seg] = self._run(v, xs[seg])
                else:
                    self.stats.replica_calls += len(copies) - 1
                    self._run_replicas(copies, xs, ys, seg, n)
                continue
            where = decide(n, self.bytes_host, self.config.execution.missing_expert, self.cost)
            if where == "fetch":
                self.stats.expert_calls_fetched += 1
                if self.copy_stream is not None:
                    # The copy runs on its own stream while this step's resident experts compute.
                    fetches.append((seg, self._fetch_async(layer, e)))
                    continue
                fetched = self._version(layer, e, self.hi)
                self.stats.bytes_to_fast += fetched.nbytes
                ys[seg] = self._run(fetched, xs[seg])
            else:
                self.stats.expert_calls_host += 1
                host = handle.host
                if self.device.type == "cuda":
                    # Host compute overlaps with the device experts of this step.
                    xh = xs[seg].to("cpu", non_blocking=False)
                    host_jobs.append((seg.start, seg.stop, self._host_pool.submit(self._host_call, host, xh)))
                else:
                    with self._host_threads():
                        ys[seg] = self._run(host, xs[seg])
        if fetches:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_stream(self.copy_stream)
            for seg, fetched in fetches:
                _record_stream(fetched, cur)  # allocated on the copy stream, read on this one
                self.stats.bytes_to_fast += fetched.nbytes
                ys[seg] = self._run(fetched, xs[seg])
        for a, b, fut in host_jobs:
            ys[a:b] = fut.result().to(self.device, non_blocking=True)
        # Back to token order; weighted sum over each token's (kept) experts.
        w = weights.reshape(-1).to(ys.dtype)
        full = torch.zeros(t * k, h.shape[1], dtype=ys.dtype, device=ys.device)
        full.index_copy_(0, order, ys)
        w = torch.where(valid, w, torch.zeros_like(w))
        return torch.bmm(w.view(t, 1, k), full.view(t, k, -1))[:, 0]

    def _fetch_async(self, layer: int, expert: int) -> ExpertVersion:
        """Start copying an expert to the device on the copy stream (pinned source: asynchronous)."""
        host = self.handles[layer][expert].host
        with torch.cuda.stream(self.copy_stream):
            return make_version(host.w13, host.w2, self.hi, self.device, self.group, non_blocking=True)

    def _run_replicas(self, copies: tuple[ExpertVersion, ...], xs: torch.Tensor, ys: torch.Tensor, seg: slice,
                      n: int) -> None:
        """Split an expert's tokens across its copies; on a GPU each copy runs on its own stream."""
        parts = split_slices(n, len(copies))
        if self.device.type != "cuda":
            for c, part in zip(copies, parts, strict=True):
                rows = slice(seg.start + part.start, seg.start + part.stop)
                ys[rows] = self._run(c, xs[rows])
            return
        cur = torch.cuda.current_stream(self.device)
        while len(self._replica_streams) < len(copies):
            self._replica_streams.append(torch.cuda.Stream(self.device))
        for c, part, stream in zip(copies, parts, self._replica_streams, strict=False):
            rows = slice(seg.start + part.start, seg.start + part.stop)
            stream.wait_stream(cur)
            with torch.cuda.stream(stream):
                ys[rows] = self._run(c, xs[rows])
        for stream in self._replica_streams[: len(copies)]:
            cur.wait_stream(stream)

    def _host_call(self, v: ExpertVersion, x: torch.Tensor) -> torch.Tensor:
        with self._host_threads():
            return self._run(v, x)

    def fast_bytes(self) -> int:
        total = 0
        for hs in self.handles.values():
            for h in hs:
                if h.fast is not None:
                    total += h.fast.nbytes
                total += sum(r.nbytes for r in h.replicas)
        return total

    def expert_table(self) -> dict[tuple[int, int], tuple[bool, str, int]]:
        """(layer, expert) -> (resident on the fast tier, precision it runs in, replicas)."""
        out = {}
        for layer, hs in self.handles.items():
            for e, h in enumerate(hs):
                v = h.fast
                out[(layer, e)] = (v is not None, v.precision if v is not None else h.host.precision,
                                   len(h.replicas))
        return out

    def close(self) -> None:
        self.drain()
        self._copier.shutdown(wait=True)
        self._host_pool.shutdown(wait=True)

