"""The expert store and the hybrid expert executor: the mechanism behind the residency knobs.

Every expert has a stable :class:`ExpertHandle`. Its ``host`` version (the slow tier) always exists;
``fast`` is the copy resident on the fast tier (high or low precision), or None. Promotions are built
off to the side (on a background thread, on their own CUDA stream where there is one) and swapped in
by one attribute assignment, so a forward pass that read a handle always runs a complete version.

:class:`HybridExperts` executes plans and decides nothing: the
:class:`~engine.moe.policy.controller.ResidencyController` says, per step and MoE layer, which
experts run resident (in which precision), on the host or fetched, how replicas split tokens and
what the cache admits and evicts; after each step it says which experts move between tiers. The
executor makes the fast tier match (waiting for a background copy only when a plan needs it) and
runs the experts. Statistics come from the plans, not from here.

One MoE forward serves every path: :class:`Grouped` groups a micro-batch's tokens by expert and
combines the outputs; the paths differ only in the kernel they call (:func:`_product` for one
weight, :func:`swiglu` for one expert, :func:`fused_moe` for a whole layer in one native call).

Without an accelerator both tiers are host memory: the same code runs (and is tested), but the
timing effects of tiers are not a GPU box's; results say ``hybrid: false``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from engine import kernels
from engine.config import EngineConfig
from engine.model.arch import ModelSpec
from engine.moe.planning import tier_precisions
from engine.moe.policy import CostModel
from engine.moe.policy.controller import PlanSettings, ResidencyController
from engine.moe.policy.plan import DecisionLog, ExpertRun, LayerDecision, PartPlan, StepMoves, TierStats
from engine.precision import FLOAT_PRECISIONS, expert_nbytes, precision_of, torch_dtype

__all__ = ["ExpertHandle", "ExpertVersion", "Grouped", "HybridExperts", "StackedExperts", "expert_nbytes",
           "fused_moe", "make_version", "precision_of", "stack_versions", "swiglu"]

log = logging.getLogger(__name__)


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


def make_version(w13: torch.Tensor, w2: torch.Tensor, precision: str, device: torch.device, group_size: int,
                 pin: bool = False, non_blocking: bool = False, native: bool = False) -> ExpertVersion:
    """Build a version of an expert in ``precision`` on ``device`` from float weights (``native``: int4 in
    the layout of moetune's CPU kernels)."""
    if precision in FLOAT_PRECISIONS:
        # On the CPU the fast tier is the host's memory: a version in the dtype the weights already have is
        # the host tensors themselves (nothing writes into a version; a tier change swaps in another one).
        # Copying them was most of a static-residency trial's reconfigure in the first command on
        # qwen3_moe-small (1.46 s; 0.31 s with this).
        copy = not (device.type == "cpu" and w13.device.type == "cpu")
        a = w13.to(device=device, dtype=torch_dtype(precision), copy=copy, non_blocking=non_blocking)
        b = w2.to(device=device, dtype=torch_dtype(precision), copy=copy, non_blocking=non_blocking)
        if pin and device.type == "cpu" and torch.cuda.is_available():
            a, b = a.pin_memory(), b.pin_memory()
        return ExpertVersion(a, b, precision, device, a.numel() * a.element_size() + b.numel() * b.element_size())
    quant = _quant()
    qa = quant.quantize(w13.float(), precision, group_size=group_size, native=native).to(device)
    qb = quant.quantize(w2.float(), precision, group_size=group_size, native=native).to(device)
    return ExpertVersion(qa, qb, precision, device, qa.nbytes() + qb.nbytes())



@dataclass(frozen=True, eq=False)
class StackedExperts:
    """Every expert of one MoE layer in one integer precision, stacked along a first dimension, as the
    native kernels' stacked MoE op reads them (:func:`engine.kernels.moe_stacked`): one call per layer
    with no per-expert tensor objects to pass. ``w13`` [E, 2I, H] and ``w2`` [E, H, I] as int8 with row
    scales ``s13`` [E, 2I] and ``s2`` [E, H], or int4 in the native layout with group scales."""

    precision: str
    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    group_size: int | None
    hidden: int
    inter: int

    @property
    def n_experts(self) -> int:
        return int(self.w13.shape[0])


def stack_versions(versions: Sequence[ExpertVersion]) -> tuple[StackedExperts, list[ExpertVersion]]:
    """One layer's experts, each an int8 or ``int4_native`` host version in one precision, stacked into one
    tensor per weight and scale; returns the stack and the versions rebuilt as views into it (the same
    bits: replacing the originals with them keeps one copy in memory)."""
    first = versions[0]
    a, b = first.w13, first.w2
    st = StackedExperts(first.precision, torch.stack([v.w13.data for v in versions]),
                        torch.stack([v.w13.scales for v in versions]), torch.stack([v.w2.data for v in versions]),
                        torch.stack([v.w2.scales for v in versions]), a.group_size, a.shape[1], b.shape[1])
    views = [ExpertVersion(replace(v.w13, data=st.w13[e], scales=st.s13[e]),
                           replace(v.w2, data=st.w2[e], scales=st.s2[e]), v.precision, v.device, v.nbytes)
             for e, v in enumerate(versions)]
    return st, views


def stackable(v: ExpertVersion | None, precision: str) -> bool:
    """Whether ``v`` is a host version in ``precision`` that the native stacked MoE op reads."""
    return (v is not None and v.precision == precision and v.device.type == "cpu"
            and (precision == "int8" or (precision == "int4" and v.w13.layout == "int4_native")))


@dataclass
class SmPartition:
    """A CUDA green context holding ``expert_sms`` of the device's ``sms`` SMs and a stream on it, for expert
    compute; ``inert`` says why there is none where a share below 1 was asked for."""

    stream: Any = None
    green: Any = None
    expert_sms: int = 0
    sms: int = 0
    inert: str | None = None


def sm_partition(device: torch.device, share: float) -> SmPartition:
    """``execution.expert_sm_share`` as a real SM partition (None on the CPU or at a share of 1).

    Green contexts (CUDA 12.4+ driver API, exposed as ``torch.cuda.green_contexts``) confine the kernels
    of their streams to their SMs; transfers, attention and collectives stay on the default context's
    streams (expert parallelism also caps NCCL's CTAs to the rest: ``engine.parallel.group``)."""
    if device.type != "cuda" or share >= 1.0:
        return SmPartition()
    try:
        from torch.cuda.green_contexts import SUPPORTED, GreenContext
    except ImportError:
        SUPPORTED = False
    if not SUPPORTED:
        return SmPartition(inert="this PyTorch build has no CUDA green contexts")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    n = expert_sms(share, sms)
    try:
        green = GreenContext.create(num_sms=n, device_id=device.index or 0)
        stream = green.Stream()
    except Exception as e:  # driver too old, MIG, ...: say so rather than ignore the knob
        return SmPartition(inert=f"green context with {n} SMs failed: {e}")
    log.info("expert compute on a green context of %d of %d SMs", n, sms)
    return SmPartition(stream, green, n, sms)


def expert_sms(share: float, sms: int) -> int:
    """SMs a share gives expert compute: at least one, and one left for everything else."""
    return min(max(1, int(round(share * sms))), max(1, sms - 1))

class VersionCache:
    """Quantized expert versions (int8, int4) built from one loaded decoder's weights, kept for the
    executors that a reconfigure builds later on the same weights: a tuner trying int8 or int4 experts
    quantizes each expert once per study, not once per trial and re-plan (5 s of a 10 s trial overhead
    here). Versions are immutable once built. Holds at most ``max_bytes`` (set from the memory available
    when the decoder loads); beyond that new versions are built and not kept."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._kept: dict[tuple[Any, ...], ExpertVersion] = {}
        self._stacks: dict[tuple[Any, ...], tuple[StackedExperts, list[ExpertVersion]]] = {}

    def get(self, key: tuple[Any, ...]) -> ExpertVersion | None:
        return self._kept.get(key)

    def stacked(self, key: tuple[Any, ...]) -> tuple[StackedExperts, list[ExpertVersion]] | None:
        """A layer's experts stacked by :meth:`keep_stacked` under ``key``, with their view versions."""
        return self._stacks.get(key)

    def keep_stacked(self, key: tuple[Any, ...], stacked: StackedExperts, views: list[ExpertVersion],
                     expert_keys: Sequence[tuple[Any, ...]]) -> None:
        """Keep a layer's stack when every one of its experts was kept (``expert_keys``): the kept
        versions become the views into it, so the stack takes no bytes beyond theirs."""
        if all(k in self._kept for k in expert_keys):
            for k, v in zip(expert_keys, views, strict=True):
                self._kept[k] = v
            self._stacks[key] = (stacked, views)

    def put(self, key: tuple[Any, ...], version: ExpertVersion) -> None:
        if key not in self._kept and self.bytes + version.nbytes <= self.max_bytes:
            self._kept[key] = version
            self.bytes += version.nbytes

    def __len__(self) -> int:
        return len(self._kept)


class ExpertHandle:
    """Stable reference to an expert; ``fast`` and ``replicas`` are replaced whole, never mutated."""

    __slots__ = ("host", "fast", "replicas")

    def __init__(self, host: ExpertVersion):
        self.host = host
        self.fast: ExpertVersion | None = None
        self.replicas: tuple[ExpertVersion, ...] = ()




# ---------------------------------------------------------------------------------------------- kernels
# One function per kernel family: one weight (:func:`_product`), one expert (:func:`swiglu`), a whole
# layer in one native call (:func:`fused_moe`).

def swiglu(v: ExpertVersion, x: torch.Tensor, native: bool) -> torch.Tensor:
    """SwiGLU expert on version ``v``: x [n, H] on v's device in the compute dtype -> [n, H]."""
    want = torch_dtype(v.precision) if v.precision in FLOAT_PRECISIONS else None
    if want is None or want == x.dtype or (native and v.device.type == "cpu" and want in kernels.HALF_DTYPES):
        xin = x  # same dtype, integer weights, or fp32 products read straight from half weights
    else:
        xin = x.to(want)  # a float copy in another precision
    gu = v.linear13(xin, native)  # [n, 2I]
    inter = gu.shape[-1] // 2
    return v.linear2(F.silu(gu[:, :inter]) * gu[:, inter:], native).to(x.dtype)  # [n, H]


def fused_moe(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, versions: dict[int, ExpertVersion],
              n_experts: int) -> torch.Tensor | None:
    """Every routed expert of a micro-batch in one native call, when all of ``versions`` (expert ->
    the copy it runs on) are host-memory copies in one precision the fused kernels read (bf16/fp16, int8
    with row scales, int4 in the ``int4_native`` layout) and the measured path for this many tokens per
    expert is native (:func:`engine.kernels.fused_moe`); None otherwise. h [T, H] fp32, weights/ids
    [T, K] (-1 = skipped slot)."""
    precisions = {v.precision for v in versions.values()}
    if (len(precisions) != 1 or not precisions <= {"bf16", "fp16", "int8", "int4"}
            or any(v.device.type != "cpu" for v in versions.values())
            or any(v.precision == "int4" and v.w13.layout != "int4_native" for v in versions.values())
            or not kernels.fused_moe(next(iter(precisions)), ids.numel() / n_experts)):
        return None
    return kernels.moe_experts(h, [versions[e].w13 if e in versions else None for e in range(n_experts)],
                               [versions[e].w2 if e in versions else None for e in range(n_experts)],
                               ids, weights)


# ------------------------------------------------------------------------------- grouping and combining

class Grouped:
    """One micro-batch's (token, slot) pairs grouped by expert, and the combine back to token order.

    ``xs`` [N, H] holds the hidden state of every kept (token, slot) pair, the rows of expert ``e``
    at ``segment[e]``; :meth:`combine` takes the experts' outputs in the same order and returns the
    gate-weighted sum per token [T, H]. ``counts[e]`` are the pairs routed to ``e`` (from the plan).
    """

    def __init__(self, h: torch.Tensor, ids: torch.Tensor, counts: Sequence[int] | np.ndarray) -> None:
        t, k = ids.shape
        flat = ids.reshape(-1)  # [T*K]
        counts = [int(n) for n in counts]
        n_valid = sum(counts)
        self.valid = None if n_valid == t * k else flat >= 0  # [T*K] kept slots; None: every slot
        if self.valid is None:
            order = torch.argsort(flat, stable=True)
        else:  # skipped slots (-1) sort last and are cut off
            order = torch.argsort(torch.where(self.valid, flat, len(counts)), stable=True)[:n_valid]
        self.order, self.t, self.k = order, t, k
        self.xs = h.index_select(0, order // k)  # [N, H] grouped by expert
        self.segment: dict[int, slice] = {}
        start = 0
        for e, n in enumerate(counts):
            if n:
                self.segment[e] = slice(start, start + n)
                start += n

    def combine(self, ys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Back to token order and a weighted sum over each token's kept experts: [T, H]."""
        t, k = self.t, self.k
        if self.valid is None:  # a gather and a batched product (index_add_ would scatter row by row)
            inverse = torch.empty_like(self.order)
            inverse[self.order] = torch.arange(self.order.numel(), device=self.order.device)
            y = ys.index_select(0, inverse).view(t, k, -1)  # [T, K, H]
            return torch.bmm(weights.to(ys.dtype)[:, None, :], y)[:, 0]
        full = torch.zeros(t * k, ys.shape[1], dtype=ys.dtype, device=ys.device)
        full.index_copy_(0, self.order, ys)
        w = weights.reshape(-1).to(ys.dtype)
        w = torch.where(self.valid, w, torch.zeros_like(w))
        return torch.bmm(w.view(t, 1, k), full.view(t, k, -1))[:, 0]


def part_counts(runs: Sequence[ExpertRun], n_experts: int) -> np.ndarray:
    """Tokens per expert of a micro-batch, from its plan."""
    counts = np.zeros(n_experts, np.int64)
    for r in runs:
        counts[r.expert] = r.tokens
    return counts


# ---------------------------------------------------------------------------------------------- executor

class HybridExperts:
    """Executes the controller's plans for every MoE layer: residency, precision, missing-expert
    execution, replicas and batching (see the module docstring)."""

    def __init__(self, spec: ModelSpec, config: EngineConfig, w13: dict[int, torch.Tensor],
                 w2: dict[int, torch.Tensor], device: torch.device, compute_dtype: torch.dtype,
                 cost: CostModel | None, settings: PlanSettings, versions: VersionCache | None = None):
        self.spec, self.config, self.device, self.dtype, self.cost = spec, config, device, compute_dtype, cost
        self.versions = versions
        self.settings = settings
        # The weights as loaded: the compute dtype, or bf16/fp16 that the native CPU kernels read as is.
        loaded = precision_of(next(iter(w13.values())).dtype)
        self.native = (compute_dtype == torch.float32 and config.runtime.cpu_kernels != "torch"
                       and kernels.load() is not None)
        self.hi, self.lo = tier_precisions(config, loaded)
        self.loaded = loaded
        self.group = config.experts.int4_group_size
        self.moe_layers = list(spec.moe_layers)
        self.layer_index = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.controller: ResidencyController | None = None
        self._hotness: np.ndarray | None = None
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetune-promote")
        self._jobs: dict[tuple[int, int], Future] = {}  # latest background job touching (layer, expert)
        self._host_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetune-host-experts")
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._replica_streams: list[torch.cuda.Stream] = []
        self.inert: dict[str, str] = {}
        self.expert_stream = self._sm_partition_stream()
        # Per MoE layer, its experts stacked (int8/int4 on the host, trivial plans): one native call a layer.
        self._stacked: dict[int, StackedExperts] = {}
        self.stacked: list[StackedExperts] | None = None
        """Every MoE layer's stacked experts, in layer order, while every layer has them (else None): what a
        fused decode step runs on. A new list whenever they change (readers compare identity)."""
        # Host versions: the weights as loaded, in host memory (pinned with a GPU). When every expert
        # stays resident in the loaded precision, the loaded weights are the fast copies.
        self.all_as_loaded = settings.resident_as_loaded
        self.handles: dict[int, list[ExpertHandle]] = {}
        pin = device.type == "cuda"
        bytes_host = settings.bytes_host
        for layer in self.moe_layers:
            hs = []
            for e in range(spec.n_experts):
                a, b = w13[layer][e], w2[layer][e]
                if a.device.type != "cpu" and not self.all_as_loaded:
                    a, b = a.cpu(), b.cpu()
                elif pin and a.device.type == "cpu":
                    a, b = a.pin_memory(), b.pin_memory()
                v = ExpertVersion(a, b, loaded, a.device, bytes_host)
                h = ExpertHandle(v)
                if self.all_as_loaded:
                    h.fast = v
                hs.append(h)
            self.handles[layer] = hs

    # ------------------------------------------------------------------ planning
    @property
    def stats(self) -> TierStats:
        """What the tiers did, counted from the plans since the last :meth:`reset`."""
        assert self.controller is not None
        return self.controller.stats

    def plan(self, hotness: np.ndarray | None) -> None:
        """Start from the placement a hotness profile [MoE layers, E] (shares per layer) gives."""
        self._hotness = hotness
        self.reset()

    def reset(self, log: DecisionLog | None = None) -> None:
        """A fresh controller from the hotness profile (its decisions go to ``log``), and the fast tier
        made to match its initial placement now."""
        self.drain()
        self.controller = ResidencyController(self.settings, self._hotness, self.cost, log)
        tiers = self.controller.tiers
        for li, layer in enumerate(self.moe_layers):
            for e, h in enumerate(self.handles[layer]):
                want = self._precision(int(tiers[li, e]))
                if want is None:
                    h.fast = None
                elif h.fast is None or h.fast.precision != want:
                    h.fast = self._version(layer, e, want)
                h.replicas = ()
        self._stack()

    def _stack(self) -> None:
        """Where every plan is trivial (every expert resident in ``hi``, one product per step, no moves) and
        the resident copies are int8/int4 host versions the native kernels read, stack each layer's copies:
        the layer then runs in one native call with no per-expert arguments to marshal (at one token a
        layer, the lists cost more than the products' difference between int8 and bf16). The handles get
        views into the stack, so memory holds one copy."""
        self._stacked = {}
        self.stacked = None
        if not (self.settings.trivial and self.native and self.device.type == "cpu" and self.hi in ("int8", "int4")):
            return
        for layer in self.moe_layers:
            hs = self.handles[layer]
            key = (layer, self.hi, self.group, self.native)
            kept = self.versions.stacked(key) if self.versions is not None else None
            if kept is None:
                if not all(stackable(h.fast, self.hi) for h in hs):
                    continue
                st, views = stack_versions([h.fast for h in hs])  # type: ignore[misc]
                if self.versions is not None:
                    self.versions.keep_stacked(key, st, views, [(layer, e, *key[1:]) for e in range(len(hs))])
            else:
                st, views = kept
            for h, v in zip(hs, views, strict=True):
                h.fast = v
            self._stacked[layer] = st
        self.stacked = [self._stacked[layer] for layer in self.moe_layers] \
            if len(self._stacked) == len(self.moe_layers) else None

    def _precision(self, code: int) -> str | None:
        return self.hi if code == 2 else self.lo if code == 1 else None

    def _version(self, layer: int, expert: int, precision: str) -> ExpertVersion:
        host = self.handles[layer][expert].host
        if self.copy_stream is not None:
            with torch.cuda.stream(self.copy_stream):
                v = make_version(host.w13, host.w2, precision, self.device, self.group)
            self.copy_stream.synchronize()
            return v
        if self.versions is None or precision in FLOAT_PRECISIONS or self.device.type != "cpu":
            return make_version(host.w13, host.w2, precision, self.device, self.group, native=self.native)
        key = (layer, expert, precision, self.group, self.native)
        v = self.versions.get(key)
        if v is None:
            v = make_version(host.w13, host.w2, precision, self.device, self.group, native=self.native)
            self.versions.put(key, v)
        return v

    def _wait(self, layer: int, expert: int) -> None:
        """Wait for the background copy of (layer, expert), if one is queued."""
        job = self._jobs.pop((layer, expert), None)
        if job is not None:
            job.result()

    def _copy_async(self, layer: int, expert: int, precision: str | None) -> None:
        """Queue a tier change of one expert: a copy in ``precision`` swapped in when complete (one
        assignment: readers see the old or the new complete version), or a drop (``None``)."""

        def work() -> None:
            h = self.handles[layer][expert]
            h.fast = None if precision is None else self._version(layer, expert, precision)

        self._jobs[(layer, expert)] = self._copier.submit(work)

    def drain(self) -> None:
        """Wait for background copies (end of run, tests)."""
        jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            job.result()

    def observe(self, counts: np.ndarray | None, tokens: int) -> StepMoves:
        """After a step: per-MoE-layer routed counts [L, E] go to the controller; its moves are applied."""
        assert self.controller is not None
        moves = self.controller.end_step(counts, tokens)
        self.apply(moves)
        return moves

    def apply(self, moves: StepMoves) -> None:
        """Make the fast tier follow ``moves``: tier changes copy in the background (a plan that needs
        one waits for it), replica counts are built now."""
        for m in (*moves.demotions, *moves.promotions):
            layer = self.moe_layers[m.layer]
            self._stacked.pop(layer, None)
            self.stacked = None
            self._copy_async(layer, m.expert, self._precision({"hi": 2, "lo": 1, "host": 0}[m.dst]))
        for change in moves.replicas:
            layer = self.moe_layers[change.layer]
            self._stacked.pop(layer, None)
            self.stacked = None
            self.handles[layer][change.expert].replicas = tuple(
                self._version(layer, change.expert, self.hi) for _ in range(change.replicas))

    def _sm_partition_stream(self) -> torch.cuda.Stream | None:
        """A stream on a CUDA green context holding ``expert_sm_share`` of the SMs, for expert compute
        (:func:`sm_partition`); where none can be had the knob is reported inert with the reason."""
        part = sm_partition(self.device, self.config.execution.expert_sm_share)
        if part.inert:
            self.inert["execution.expert_sm_share"] = part.inert
        self._green = part.green
        return part.stream

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
        return swiglu(v, x, self.native)

    def forward(self, layer: int, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                decision: LayerDecision | None = None) -> torch.Tensor:
        """Experts of one MoE layer for a step, as ``decision`` plans them (planned here when not
        given). h [T, H]; weights/ids [T, K] (id -1 = skipped slot)."""
        assert self.controller is not None
        if decision is None:
            decision = self.controller.plan_layer(self.layer_index[layer], ids.cpu().numpy())
        stacked = self._stacked.get(layer)
        if (stacked is not None and decision.trivial and h.device.type == "cpu"
                and kernels.fused_moe(stacked.precision, ids.numel() / stacked.n_experts)):
            return kernels.moe_stacked(h, stacked, ids, weights)
        out = torch.empty_like(h)  # every row belongs to one micro-batch
        stream = self.expert_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else _null():
            for part in decision.parts:
                sl = slice(part.start, part.stop)
                out[sl] = self._execute(layer, part, h[sl], weights[sl], ids[sl])
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        if decision.prefetch or decision.prefetch_evicted:
            nxt = self.moe_layers[decision.layer + 1]
            for e in decision.prefetch_evicted:
                self._copy_async(nxt, e, None)
            for e in decision.prefetch:
                self._copy_async(nxt, e, self.hi)
        return out

    def _resident(self, layer: int, expert: int, where: str) -> ExpertVersion:
        """The fast copy a plan runs ``expert`` on, waiting for its background copy if it is queued."""
        self._wait(layer, expert)
        v = self.handles[layer][expert].fast  # read once: a concurrent swap cannot split this call
        want = self.hi if where == "hi" else self.lo
        if v is None or v.precision != want:
            raise RuntimeError(f"plan runs expert {expert} of layer {layer} resident in {want}, but the fast "
                               f"tier holds {v.precision if v is not None else 'nothing'} for it")
        return v

    def _execute(self, layer: int, part: PartPlan, h: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
        """One micro-batch as planned: cache changes first, then the experts."""
        hs = self.handles[layer]
        if part.cache is not None:
            for e in part.cache.evictions:
                self._wait(layer, e)
                hs[e].fast = None
            for e in part.admitted:  # a miss the cache took in: copy it up now and keep it
                self._wait(layer, e)
                hs[e].fast = self._version(layer, e, self.hi)
        fused = self._run_fused(layer, h, weights, ids, part)
        if fused is not None:
            return fused
        return self._run_grouped(layer, part, h, weights, ids)

    def _run_fused(self, layer: int, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   part: PartPlan | None = None) -> torch.Tensor | None:
        """The micro-batch in one native call (:func:`fused_moe`) when every planned expert runs from
        host memory without a fetch or replicas and the measured path for its tokens per expert is native;
        None when the grouped path must run (then long prompt chunks run expert by expert, each on its
        token count's path). Without a
        ``part`` the controller plans it (one coalesced micro-batch)."""
        if part is None:
            assert self.controller is not None
            part = self.controller.plan_layer(self.layer_index[layer], ids.cpu().numpy()).parts[0]
        if not self.native or h.device.type != "cpu":
            return None
        hs = self.handles[layer]
        versions = {}
        for run in part.runs:
            if run.split or run.where == "fetch":
                return None
            versions[run.expert] = hs[run.expert].host if run.where == "host" else \
                self._resident(layer, run.expert, run.where)
        return fused_moe(h, weights, ids, versions, self.spec.n_experts)

    def _run_grouped(self, layer: int, part: PartPlan, h: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
        """Each planned expert over its grouped tokens: resident (replicas split the rows), on the host
        (overlapped on a thread with a GPU), or fetched (on the copy stream with a GPU)."""
        g = Grouped(h, ids, part_counts(part.runs, self.spec.n_experts))
        xs = g.xs
        ys = torch.empty_like(xs)
        hs = self.handles[layer]
        host_jobs: list[tuple[slice, Future]] = []
        fetches: list[tuple[slice, ExpertVersion]] = []
        for run in part.runs:
            e = run.expert
            seg = g.segment[e]
            if run.where in ("hi", "lo"):
                v = self._resident(layer, e, run.where)
                if run.split:
                    self._run_replicas((v, *hs[e].replicas[: len(run.split) - 1]), xs, ys, seg, run.split)
                else:
                    ys[seg] = self._run(v, xs[seg])
            elif run.where == "fetch":
                if self.copy_stream is not None:
                    # The copy runs on its own stream while this step's resident experts compute.
                    fetches.append((seg, self._fetch_async(layer, e)))
                    continue
                ys[seg] = self._run(self._version(layer, e, self.hi), xs[seg])
            elif self.device.type == "cuda":
                # Host compute overlaps with the device experts of this step.
                xh = xs[seg].to("cpu", non_blocking=False)
                host_jobs.append((seg, self._host_pool.submit(self._host_call, hs[e].host, xh)))
            else:
                with self._host_threads():
                    ys[seg] = self._run(hs[e].host, xs[seg])
        if fetches:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_stream(self.copy_stream)
            for seg, fetched in fetches:
                _record_stream(fetched, cur)  # allocated on the copy stream, read on this one
                ys[seg] = self._run(fetched, xs[seg])
        for seg, fut in host_jobs:
            ys[seg] = fut.result().to(self.device, non_blocking=True)
        return g.combine(ys, weights)

    def _fetch_async(self, layer: int, expert: int) -> ExpertVersion:
        """Start copying an expert to the device on the copy stream (pinned source: asynchronous)."""
        host = self.handles[layer][expert].host
        with torch.cuda.stream(self.copy_stream):
            return make_version(host.w13, host.w2, self.hi, self.device, self.group, non_blocking=True)

    def _run_replicas(self, copies: tuple[ExpertVersion, ...], xs: torch.Tensor, ys: torch.Tensor, seg: slice,
                      split: Sequence[int]) -> None:
        """Split an expert's rows across its copies as planned; on a GPU each copy runs on its own stream."""
        if len(copies) != len(split):
            raise RuntimeError(f"plan splits an expert over {len(split)} copies; {len(copies)} exist")
        bounds = np.concatenate([[0], np.cumsum(split)]).tolist()
        parts = [slice(seg.start + int(a), seg.start + int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        if self.device.type != "cuda":
            for c, rows in zip(copies, parts, strict=True):
                ys[rows] = self._run(c, xs[rows])
            return
        cur = torch.cuda.current_stream(self.device)
        while len(self._replica_streams) < len(copies):
            self._replica_streams.append(torch.cuda.Stream(self.device))
        for c, rows, stream in zip(copies, parts, self._replica_streams, strict=False):
            stream.wait_stream(cur)
            with torch.cuda.stream(stream):
                ys[rows] = self._run(c, xs[rows])
        for stream in self._replica_streams[: len(copies)]:
            cur.wait_stream(stream)

    def _host_call(self, v: ExpertVersion, x: torch.Tensor) -> torch.Tensor:
        with self._host_threads():
            return self._run(v, x)

    def fast_bytes(self) -> int:
        """Bytes of expert copies on the fast tier now (resident copies and replicas)."""
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
