"""The knob registry: every engine setting, declared once.

Each area of the engine has one frozen dataclass; each field is declared with :func:`knob`, which
records its default, bounds or choices, a one-line docstring and, where the tuner may search it,
its search range. CLI flags (:func:`add_cli_args`), validation (:meth:`EngineConfig.from_dict`),
``engine knobs`` (:func:`knob_table`), the tuner's search space and exported config files are all
derived from these declarations; nothing else restates a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from engine.precision import INT4_GROUP_SIZES

_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "int8": 8, "int4": 4}
_COMPUTE_PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


class ConfigError(ValueError):
    """A configuration that cannot work; the message is one line naming the key and the value."""


@dataclass(frozen=True)
class Search:
    """How the tuner searches a knob: a numeric range (``low``..``high``) or a list of choices.

    ``Search()`` on a knob typed ``Literal[...]`` searches every choice of the type (nothing restated).
    """

    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] | None = None


def knob(
    default: Any,
    doc: str,
    *,
    min: float | None = None,  # noqa: A002 - mirrors the registry's vocabulary
    max: float | None = None,  # noqa: A002
    search: Search | None = None,
    behaviour: bool = True,
    when: dict[str, tuple[Any, ...]] | None = None,
    needs: str | None = None,
    executor: bool = True,
) -> Any:
    """Declare one knob.

    ``behaviour=False`` keeps a knob out of the config hash (it changes neither results nor speed).
    ``when`` makes a knob conditional: it acts (and is searched) only when each named knob of the same
    config has one of the listed values. ``needs="gpu"`` marks knobs that can only act on an NVIDIA GPU;
    ``needs="accelerator"`` those whose effect needs a fast tier distinct from host memory; ``needs="cpu"``
    those that act only where the model runs on the CPU (the native kernels'), not on a GPU.
    ``executor=False`` marks a knob of the expert areas (:data:`EXPERT_AREAS`) that the plain engine
    honours itself, without the hybrid expert executor (see :func:`departures_from_plain`).
    """
    meta = {"doc": doc, "min": min, "max": max, "search": search, "behaviour": behaviour,
            "when": when or {}, "needs": needs, "executor": executor}
    if isinstance(default, (list, dict)):
        raise TypeError("knob defaults must be immutable")
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and in which precision the engine computes."""

    device: Literal["auto", "cpu", "cuda"] = knob(
        "auto", "Device for the model: cuda when present under auto, else cpu.")
    compute_dtype: Literal["auto", "checkpoint", "float32", "bfloat16", "float16"] = knob(
        "auto",
        "Precision of activations and matrix products: auto = the stored dtype on a GPU; on a CPU, fp32 "
        "activations on the weights as stored where the native kernels run (their measured path table "
        "picks bf16 arithmetic per token count), else the faster of the stored dtype and fp32 in PyTorch, "
        "measured once; checkpoint keeps the stored dtype.",
        search=Search(choices=("auto", "checkpoint", "float32")),
    )
    cpu_kernels: Literal["auto", "native", "torch"] = knob(
        "auto",
        "CPU products of fp32 activations: native = moetune's compiled kernels read bf16/fp16 weights as "
        "stored (half the bytes of fp32); torch = PyTorch only, weights widened to the compute dtype; "
        "auto = native when it builds here.",
        search=Search(choices=("auto", "torch")),
    )
    kv_dtype: Literal["auto", "float32", "bfloat16"] = knob(
        "auto",
        "Precision of the KV cache: auto = the compute dtype; bfloat16 halves the cache's bytes (memory and "
        "the bytes decode attention reads) at a quality cost that `engine eval` measures.",
        search=Search(choices=("auto", "bfloat16")),
    )
    dense_precision: Literal["as_loaded", "int8"] = knob(
        "as_loaded",
        "Precision of the dense matrices every token reads (attention projections, dense MLP layers, shared "
        "experts, lm head; routers stay in the compute dtype): as_loaded = the weight dtype; int8 = int8 "
        "copies with an fp32 scale per 32 weights of a row (as llama.cpp's q8_0 stores them: about half the bytes "
        "of bf16), made once "
        "and run on the native CPU kernels (an error where they do not run). Experts: experts.hi_precision.",
        search=Search(choices=("as_loaded", "int8")),
        when={"cpu_kernels": ("auto", "native"), "compute_dtype": ("auto", "float32")}, needs="cpu")
    threads: int = knob(
        0, "Host threads for PyTorch ops (0 = every core this process may use).", min=0, max=1024)
    seed: int = knob(0, "Seed for sampling and for synthesised prompt tokens.", min=0, max=2**31 - 1)


@dataclass(frozen=True)
class SchedulerConfig:
    """How requests are batched into steps (continuous batching with chunked prefill)."""

    max_batch_seqs: int = knob(
        32, "Most sequences running in one step (prefill and decode together).", min=1, max=4096,
        search=Search(low=1, high=64, log=True))
    max_batch_tokens: int = knob(
        1024, "Most tokens (prefill chunk tokens + one per decoding sequence) in one step.", min=1,
        max=1 << 20, search=Search(low=64, high=4096, log=True))
    prefill_chunk_tokens: int = knob(
        512, "Longest piece of one prompt prefilled in one step; longer prompts prefill over several steps.",
        min=1, max=1 << 20, search=Search(low=32, high=2048, log=True))
    max_seq_len_tokens: int = knob(
        4096, "Longest sequence (prompt + output) the KV cache holds; longer requests are rejected.",
        min=2, max=1 << 22)


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen (requests may not override these yet)."""

    temperature: float = knob(0.0, "Softmax temperature; 0 means greedy decoding.", min=0.0, max=100.0)
    top_k: int = knob(0, "Sample only among the k most likely tokens (0 = all).", min=0, max=1 << 20)
    top_p: float = knob(1.0, "Sample only among the smallest set of tokens whose mass reaches p.",
                        min=0.0, max=1.0)
    ignore_eos: bool = knob(
        True, "Keep generating past the end-of-sequence token until max_new_tokens (workload replay "
        "needs the recorded output lengths).")


HOTNESS_RESIDENCIES = ("static", "dynamic")
"""Residency policies placed from a hotness profile (a router trace, or warm-up routing)."""
PLANNED_RESIDENCIES = (*HOTNESS_RESIDENCIES, "cache")
"""Residency policies that keep only some experts on the fast tier."""
_PLANNED = {"residency": PLANNED_RESIDENCIES}
_HOT = {"residency": HOTNESS_RESIDENCIES}
_REPLICATED = {"max_replicas": tuple(range(1, 17))}


@dataclass(frozen=True)
class ResidencyConfig:
    """Which experts live on the fast tier, in which precision (CoX-MoE, DynaExq, FluxMoE, MoE-Infinity)."""

    residency: Literal["all", "static", "dynamic", "cache"] = knob(
        "all",
        "all: every expert on the fast tier; static: the hottest per layer from a hotness profile; dynamic: "
        "re-planned from long-horizon hotness while serving; cache: LRU/LFU expert cache.",
        search=Search())
    resident_budget_gib: float = knob(
        1.0, "Fast-tier memory for expert weights (GiB), used by static, dynamic and cache residency.",
        min=0.0, max=4096.0, search=Search(low=0.0, high=8.0), when=_PLANNED)
    budget_split: Literal["uniform", "proportional", "vector"] = knob(
        "uniform", "How the budget is split across MoE layers: equally, by recorded load, or by "
        "budget_layer_weights.", search=Search(choices=("uniform", "proportional")), when=_PLANNED)
    budget_layer_weights: str = knob(
        "", "Comma-separated relative budget per MoE layer for budget_split=vector (one per MoE layer).",
        when={"budget_split": ("vector",)})
    hotness_warmup_tokens: int = knob(
        256, "Tokens routed at start-up to count expert hotness when the workload has no router trace.",
        min=0, max=1 << 20, when=_HOT)
    dynamic_halflife_tokens: int = knob(
        2048, "Half-life (routed tokens) of the moving average of expert hotness for dynamic residency.",
        min=1, max=1 << 24, search=Search(low=256, high=16384, log=True), when={"residency": ("dynamic",)})
    dynamic_replan_tokens: int = knob(
        512, "Tokens between re-plans of the resident set under dynamic residency.", min=1, max=1 << 24,
        when={"residency": ("dynamic",)})
    dynamic_hysteresis: float = knob(
        0.2, "Promote an expert only if its hotness beats the coldest resident's by this fraction.",
        min=0.0, max=10.0, search=Search(low=0.0, high=1.0), when={"residency": ("dynamic",)})
    dynamic_max_swaps_per_replan: int = knob(
        0, "Most tier exchanges per MoE layer in one re-plan under dynamic residency (0 = one per 8 experts, "
        "at least one).", min=0, max=1 << 16, when={"residency": ("dynamic",)})
    cache_policy: Literal["lru", "lfu"] = knob(
        "lru", "Eviction order of the expert cache.", search=Search(), when={"residency": ("cache",)})
    prefetch_experts: int = knob(
        0, "Cache residency: next-layer experts to prefetch from learned co-occurrence (0 = off).",
        min=0, max=64, search=Search(low=0, high=8), when={"residency": ("cache",)})
    hi_precision: Literal["auto", "fp32", "bf16", "fp16", "int8", "int4"] = knob(
        "auto", "Precision of resident experts; auto = the compute dtype.",
        search=Search(choices=("auto", "int8", "int4")))
    lo_precision: Literal["none", "bf16", "fp16", "int8", "int4"] = knob(
        "none", "Precision of a low-precision fallback copy kept resident where the budget allows (DynaExq).",
        search=Search(choices=("none", "int8", "int4")),
        when={**_HOT, "hi_precision": ("auto", "fp32", "bf16", "fp16", "int8")})  # no copy narrower than int4
    int8_activations: Literal["auto", "fp32", "int16", "int8"] = knob(
        "auto", "How int8 experts meet the activations on the CPU kernels: fp32 = as they are (the int8 weights "
        "widened in registers: the quality of the weights alone); int16 = quantized per token in blocks of 32 to "
        "int16 (integer dot products on the weights sign-extended in registers: fp32's quality to 4 digits, "
        "faster where widening int8 to fp32 bounds a product); auto = the faster of fp32 and int16 as measured "
        "on this machine; int8 = quantized per token in blocks of 32, as llama.cpp's q8_0 does (integer dot "
        "products: faster where products are compute-bound, at a quality cost that `engine eval` measures).",
        search=Search(), when={"hi_precision": ("int8",)}, needs="cpu", executor=False)
    int4_group_size: int = knob(
        128, "Group size (input channels per scale) of int4 weights, a power of two; must divide hidden and "
        "expert widths.", min=INT4_GROUP_SIZES[0], max=INT4_GROUP_SIZES[-1],
        search=Search(choices=INT4_GROUP_SIZES[:-1]), when={"hi_precision": ("int4",)})


@dataclass(frozen=True)
class ExecutionConfig:
    """How routed tokens meet expert weights: where missing experts run, replicas, batching, partitions."""

    missing_expert: Literal["host", "fetch", "auto"] = knob(
        "auto", "A non-resident expert is computed on the host CPU, fetched to the fast tier, or either, "
        "decided per expert per step by calibrated costs.", search=Search(), when=_PLANNED, needs="accelerator")
    max_replicas: int = knob(
        0, "Extra copies of predicted-overloaded experts whose tokens are split across them (0 = off).",
        min=0, max=16, search=Search(low=0, high=3), needs="accelerator")
    replica_threshold: float = knob(
        2.0, "An expert is overloaded when its recent token share exceeds this multiple of the mean.",
        min=1.0, max=100.0, search=Search(low=1.5, high=8.0, log=True), when=_REPLICATED,
        needs="accelerator")
    replica_window_tokens: int = knob(
        1024, "Recent routed tokens over which overload is measured.", min=1, max=1 << 24, when=_REPLICATED,
        needs="accelerator")
    expert_batching: Literal["coalesced", "micro"] = knob(
        "coalesced", "coalesced: all of a step's tokens for an expert in one product; micro: split the step "
        "into micro-batches, overlapping one's transfers or host compute with another's device compute.",
        search=Search())
    micro_batch_tokens: int = knob(
        32, "Tokens per micro-batch under expert_batching=micro.", min=1, max=1 << 20,
        search=Search(low=4, high=256, log=True), when={"expert_batching": ("micro",)})
    expert_sm_share: float = knob(
        1.0, "Share of GPU SMs for expert compute (the rest for transfers and attention); GPU only.",
        min=0.05, max=1.0, search=Search(low=0.25, high=1.0), needs="gpu")
    host_expert_threads: int = knob(
        0, "Host threads for expert products (0 = runtime.threads); the rest of the step uses runtime.threads.",
        min=0, max=1024, search=Search(low=0, high=64))
    decode_attention: Literal["device", "host"] = knob(
        "device", "Where decode attention and its KV cache live: the model's device or the host CPU.",
        search=Search(), needs="accelerator", executor=False)


@dataclass(frozen=True)
class RoutingConfig:
    """Routing changes that trade quality for fewer expert calls (PCoMoE, KTransformers deferral)."""

    top_k_override: int = knob(
        0, "Experts per token instead of the model's top-k (0 = the model's).", min=0, max=256,
        search=Search(low=0, high=8))
    min_gate_weight: float = knob(
        0.0, "Skip experts whose renormalised gate weight is below this (the rest renormalised; top-1 kept).",
        min=0.0, max=1.0, search=Search(low=0.0, high=0.2))


_EP = {"ep_size": tuple(range(2, 65))}


@dataclass(frozen=True)
class ParallelConfig:
    """Expert parallelism across processes (``torch.distributed``): attention and dense layers replicated
    on every rank, each MoE layer's experts partitioned across ranks, outputs summed by an all-reduce."""

    ep_size: int = knob(
        1, "Ranks (processes; one GPU each on CUDA) the experts are partitioned across; 1 = one process.",
        min=1, max=64, search=Search(choices=(1, 2, 4, 8)))
    ep_placement: Literal["contiguous", "hotness", "eplb"] = knob(
        "contiguous", "Which rank holds which experts: contiguous blocks; hotness = by recorded hotness, balanced "
        "across ranks; eplb = hotness plus redundant_experts extra copies of the hottest experts on other ranks.",
        search=Search(), when=_EP)
    redundant_experts: int = knob(
        0, "eplb placement: extra expert copies per MoE layer, given to the experts with the highest load per "
        "copy; a replicated expert's tokens are split across its copies.", min=0, max=4096,
        search=Search(low=0, high=8), when={"ep_placement": ("eplb",)})
    ep_combine_chunks: int = knob(
        1, "Row chunks per MoE layer: 1 = sum the ranks' outputs after all local experts ran; N > 1 = each "
        "chunk's all-reduce runs while the next chunk's experts compute (overlap).", min=1, max=64,
        search=Search(low=1, high=4), when=_EP)
    ep_timeout_s: float = knob(
        120.0, "A collective that waits this long for another rank fails the step with one line naming it "
        "(a dead rank is reported at once).", min=1.0, max=86400.0, behaviour=False)


EXPERT_AREAS = ("experts", "execution", "routing")
"""Areas whose knobs, set away from their defaults, need the hybrid expert executor."""

EP_HONOURS = ("execution.expert_sm_share",)
"""Executor knobs expert parallelism honours itself (each rank's experts on a green context of that share
of its GPU's SMs, the combine's collectives on the rest: ``engine.parallel.ep``)."""

AREAS: dict[str, type] = {
    "runtime": RuntimeConfig,
    "scheduler": SchedulerConfig,
    "sampling": SamplingConfig,
    "experts": ResidencyConfig,
    "execution": ExecutionConfig,
    "routing": RoutingConfig,
    "parallel": ParallelConfig,
}


@dataclass(frozen=True)
class KnobInfo:
    """One knob as the rest of moetune sees it (CLI, tuner, dashboard, ``engine knobs``)."""

    area: str
    name: str
    type: Any
    default: Any
    doc: str
    min: float | None
    max: float | None
    choices: tuple[Any, ...] | None
    search: Search | None
    behaviour: bool
    when: dict[str, tuple[Any, ...]]
    needs: str | None
    executor: bool = True

    @property
    def key(self) -> str:
        return f"{self.area}.{self.name}"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def range_text(self) -> str:
        if self.choices is not None:
            return "|".join(str(c) for c in self.choices)
        if self.type is bool:
            return "true|false"
        if self.type is str:
            return "text"
        lo = "" if self.min is None else _num(self.min)
        hi = "" if self.max is None else _num(self.max)
        return f"[{lo}, {hi}]"

    def check(self, value: Any, source: str) -> Any:
        """Coerce ``value`` to the knob's type and check it, or raise a one-line ConfigError."""
        where = f"{source}: {self.key}={value!r}"
        if self.choices is not None:
            if value not in self.choices:
                raise ConfigError(f"{where}: must be one of {', '.join(map(str, self.choices))}")
            return value
        if self.type is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in {"true", "false", "1", "0", "yes", "no"}:
                return value.lower() in {"true", "1", "yes"}
            raise ConfigError(f"{where}: must be true or false")
        try:
            if self.type is int:
                if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                    raise ValueError
                coerced: Any = int(value)
            elif self.type is float:
                if isinstance(value, bool):
                    raise ValueError
                coerced = float(value)
            else:
                coerced = self.type(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: must be {self.type.__name__}") from None
        if self.min is not None and coerced < self.min:
            raise ConfigError(f"{where}: below the minimum {_num(self.min)}")
        if self.max is not None and coerced > self.max:
            raise ConfigError(f"{where}: above the maximum {_num(self.max)}")
        return coerced


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    # Resolving the annotations is what makes knobs() slow (~25 ms); they never change.
    return typing.get_type_hints(cls)


def _knob_info(area: str, cls: type, f: dataclasses.Field) -> KnobInfo:
    hints = _type_hints(cls)
    tp = hints[f.name]
    choices = None
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        tp = type(choices[0])
    meta = f.metadata
    search = meta["search"]
    if search is not None and search.choices is None and search.low is None and search.high is None:
        if choices is None:
            raise TypeError(f"knob {area}.{f.name}: Search() without a range needs a Literal type to take choices from")
        search = dataclasses.replace(search, choices=choices)  # every choice of the Literal, stated once
    return KnobInfo(area, f.name, tp, f.default, meta["doc"], meta["min"], meta["max"], choices, search,
                    meta["behaviour"], meta["when"], meta["needs"], meta["executor"] and area in EXPERT_AREAS)


@functools.cache
def _registry() -> tuple[KnobInfo, ...]:
    return tuple(_knob_info(area, cls, f) for area, cls in AREAS.items() for f in dataclasses.fields(cls))


def knobs() -> list[KnobInfo]:
    """Every knob of every area, in declaration order."""
    return list(_registry())


@functools.cache
def _by_name() -> dict[str, KnobInfo]:
    out: dict[str, KnobInfo] = {}
    for k in _registry():
        if k.name in out:  # flat names are CLI flags: they must be unique across areas
            raise RuntimeError(f"knob name {k.name} declared in two areas")
        out[k.name] = k
    return out


def _knobs_by_name() -> dict[str, KnobInfo]:
    return dict(_by_name())


@dataclass(frozen=True)
class EngineConfig:
    """The whole engine configuration: one instance of each area."""

    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    experts: ResidencyConfig = field(default_factory=ResidencyConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {area: dataclasses.asdict(getattr(self, area)) for area in AREAS}

    def config_hash(self) -> str:
        """Short hash of every knob that changes behaviour; keys caches and de-duplicates results."""
        flat = {k.key: getattr(getattr(self, k.area), k.name) for k in knobs() if k.behaviour}
        blob = json.dumps(flat, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **flat: Any) -> EngineConfig:
        """A copy with knobs changed by flat name (``max_batch_seqs=8``), validated."""
        return EngineConfig.from_dict(merge_flat(self.to_dict(), flat, "replace()"), source="replace()")

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> EngineConfig:
        """Build and validate a config from nested (``{"scheduler": {...}}``) or flat keys.

        Unknown keys and out-of-range values raise :class:`ConfigError` naming the key and value.
        """
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        nested = _nest(data, source)
        by_name = _knobs_by_name()
        parts: dict[str, dict[str, Any]] = {area: {} for area in AREAS}
        for area, values in nested.items():
            for name, value in values.items():
                info = by_name[name]
                parts[area][name] = info.check(value, source)
        cfg = cls(**{area: AREAS[area](**vals) for area, vals in parts.items()})
        cfg.validate(source)
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> EngineConfig:
        """Load a JSON config file; a tuner export (with an ``engine_config`` key) works too."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{p}: no such config file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
        if isinstance(data, dict) and "engine_config" in data:
            data = data["engine_config"]
        return cls.from_dict(data, source=str(p))

    def validate(self, source: str = "config") -> None:
        """Cross-field checks; each error names the fields and their values."""
        s = self.scheduler
        if s.max_batch_seqs > s.max_batch_tokens:
            raise ConfigError(
                f"{source}: scheduler.max_batch_seqs={s.max_batch_seqs} exceeds "
                f"scheduler.max_batch_tokens={s.max_batch_tokens} (each decoding sequence needs a token)")
        r, x = self.experts, self.execution
        if r.residency != "all" and r.resident_budget_gib == 0 and x.max_replicas > 0:
            raise ConfigError(
                f"{source}: execution.max_replicas={x.max_replicas} with experts.resident_budget_gib=0: "
                "replicas need fast-tier budget")
        if r.budget_split == "vector":
            if not r.budget_layer_weights.strip():
                raise ConfigError(f"{source}: experts.budget_split='vector' needs experts.budget_layer_weights")
            try:
                weights = [float(w) for w in r.budget_layer_weights.split(",")]
            except ValueError:
                raise ConfigError(f"{source}: experts.budget_layer_weights={r.budget_layer_weights!r}: "
                                  "expected comma-separated numbers") from None
            if any(w < 0 for w in weights) or sum(weights) <= 0:
                raise ConfigError(f"{source}: experts.budget_layer_weights={r.budget_layer_weights!r}: "
                                  "weights must be >= 0 with a positive sum")
        if r.lo_precision != "none" and r.hi_precision == r.lo_precision:
            raise ConfigError(f"{source}: experts.lo_precision={r.lo_precision!r} equals hi_precision")
        # "auto" resident experts are in the compute dtype (16 or 32 bits; unknown before load when that is auto).
        hi_bits = _BITS.get(r.hi_precision, _BITS.get(_COMPUTE_PRECISION.get(self.runtime.compute_dtype, ""), 32))
        if r.lo_precision != "none" and _BITS[r.lo_precision] >= hi_bits:
            raise ConfigError(f"{source}: experts.lo_precision={r.lo_precision!r} is not narrower than "
                              f"experts.hi_precision={r.hi_precision!r}: the fallback copy must take fewer bytes")
        p = self.parallel
        if p.ep_size > 1:
            hybrid = [k for k in departures_from_plain(self) if not k.startswith("routing.") and k not in EP_HONOURS]
            if hybrid:
                k = hybrid[0]
                area, name = k.split(".")
                raise ConfigError(
                    f"{source}: parallel.ep_size={p.ep_size} with {k}={getattr(getattr(self, area), name)!r}: "
                    "expert parallelism runs every expert resident on its rank (no hybrid executor); "
                    "use ep_size 1 for that knob")
        if p.redundant_experts and p.ep_placement != "eplb":
            raise ConfigError(f"{source}: parallel.redundant_experts={p.redundant_experts} needs "
                              f"parallel.ep_placement='eplb' (got {p.ep_placement!r})")
        rt = self.runtime
        if rt.dense_precision == "int8" and rt.cpu_kernels == "torch":
            raise ConfigError(f"{source}: runtime.dense_precision='int8' with runtime.cpu_kernels='torch': int8 "
                              "dense matrices run on the native CPU kernels only")
        if rt.dense_precision == "int8" and p.ep_size > 1:
            raise ConfigError(f"{source}: runtime.dense_precision='int8' with parallel.ep_size={p.ep_size}: the "
                              "ranks run the dense layers as loaded; use ep_size 1 for int8 dense matrices")
        if r.int4_group_size not in INT4_GROUP_SIZES:
            raise ConfigError(f"{source}: experts.int4_group_size={r.int4_group_size}: must be one of "
                              f"{', '.join(map(str, INT4_GROUP_SIZES))} (a power of two)")

    def validate_for(self, spec, device_mem_bytes: int | None, source: str = "config") -> None:
        """Checks that need the model and the machine; run before any model work."""
        r = self.experts
        if "int4" in (r.hi_precision, r.lo_precision):
            for name, dim in (("hidden_size", spec.hidden_size), ("expert width", spec.expert_intermediate)):
                if dim % r.int4_group_size:
                    raise ConfigError(
                        f"{source}: experts.int4_group_size={r.int4_group_size} does not divide the model's "
                        f"{name} {dim}")
        if r.residency != "all" and device_mem_bytes is not None and r.resident_budget_gib * 2**30 > device_mem_bytes:
            raise ConfigError(
                f"{source}: experts.resident_budget_gib={r.resident_budget_gib} exceeds the fast tier's "
                f"{device_mem_bytes / 2**30:.1f} GiB")
        if r.budget_split == "vector":
            n = len(r.budget_layer_weights.split(","))
            if n != len(spec.moe_layers):
                raise ConfigError(
                    f"{source}: experts.budget_layer_weights has {n} entries; the model has "
                    f"{len(spec.moe_layers)} MoE layers")
        p = self.parallel
        if p.ep_size > spec.n_experts:
            raise ConfigError(f"{source}: parallel.ep_size={p.ep_size} exceeds the model's {spec.n_experts} experts")
        if p.ep_size > 1 and p.redundant_experts > spec.n_experts * (p.ep_size - 1):
            raise ConfigError(
                f"{source}: parallel.redundant_experts={p.redundant_experts} exceeds n_experts * (ep_size - 1) = "
                f"{spec.n_experts * (p.ep_size - 1)} (at most one copy of an expert per rank)")
        k = self.routing.top_k_override
        if k > spec.n_experts:
            raise ConfigError(f"{source}: routing.top_k_override={k} exceeds the model's {spec.n_experts} experts")


def _nest(data: dict[str, Any], source: str) -> dict[str, dict[str, Any]]:
    """Accept nested area dicts, dotted keys and flat knob names; reject anything else."""
    by_name = _knobs_by_name()
    out: dict[str, dict[str, Any]] = {area: {} for area in AREAS}
    for key, value in data.items():
        if key in AREAS:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {key}={value!r}: expected an object of knobs")
            for name, v in value.items():
                if name not in by_name or by_name[name].area != key:
                    raise ConfigError(f"{source}: unknown key '{key}.{name}' (value {v!r})")
                out[key][name] = v
            continue
        name = key.split(".", 1)[1] if "." in key else key
        area = key.split(".", 1)[0] if "." in key else None
        if name not in by_name or (area is not None and by_name[name].area != area):
            raise ConfigError(f"{source}: unknown key '{key}' (value {value!r})")
        out[by_name[name].area][name] = value
    return out


def merge_flat(nested: Mapping[str, Mapping[str, Any]], changes: Mapping[str, Any], source: str = "config"
               ) -> dict[str, dict[str, Any]]:
    """``nested`` (``{"scheduler": {...}, ...}``) with ``changes`` applied, in flat (``max_batch_seqs``),
    dotted (``scheduler.max_batch_seqs``) or nested form; unvalidated values, unknown keys refused.
    The one flat-to-nested merge: validate the result with :meth:`EngineConfig.from_dict`."""
    out = {area: dict(values) for area, values in nested.items()}
    for area, values in _nest(dict(changes), source).items():
        out.setdefault(area, {}).update(values)
    return out


def departures_from_plain(cfg: EngineConfig) -> list[str]:
    """Keys of the expert knobs (:data:`EXPERT_AREAS`) that act in ``cfg`` and are away from their
    defaults: each needs the hybrid expert executor. Empty for a plain config."""
    return [k.key for k in knobs() if k.executor and knob_active(cfg, k)
            and getattr(getattr(cfg, k.area), k.name) != k.default]


def uses_hotness(cfg: EngineConfig) -> bool:
    """Whether ``cfg`` places anything from a hotness profile (a router trace, or warm-up routing):
    static or dynamic residency, or an expert-parallel placement other than contiguous."""
    p = cfg.parallel
    return cfg.experts.residency in HOTNESS_RESIDENCIES or (p.ep_size > 1 and p.ep_placement != "contiguous")


def knob_default(name: str) -> Any:
    """The registry's default of a knob, by flat name or ``area.name`` key."""
    key = name.split(".", 1)[-1]
    return _knobs_by_name()[key].default


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per knob; unset flags stay None so a config file or the default applies."""
    group = parser.add_argument_group("engine knobs (see `engine knobs`)")
    for k in knobs():
        kwargs: dict[str, Any] = {"default": None, "dest": f"knob__{k.name}",
                                  "help": f"{k.doc} Default {k.default}; range {k.range_text()}."}
        if k.choices is not None:
            kwargs["choices"] = k.choices
        else:
            kwargs["metavar"] = k.type.__name__.upper()
        group.add_argument(k.flag, **kwargs)


def config_from_args(args: argparse.Namespace, base: EngineConfig | None = None) -> EngineConfig:
    """Apply CLI flags on top of ``base`` (a config file or the defaults)."""
    base = base or EngineConfig()
    flat = {name[len("knob__"):]: v for name, v in vars(args).items()
            if name.startswith("knob__") and v is not None}
    if not flat:
        return base
    return EngineConfig.from_dict(merge_flat(base.to_dict(), flat, "command line"), source="command line")


def inert_knobs(has_gpu: bool) -> dict[str, str]:
    """Knobs that cannot act on this hardware, with the reason (reported in results, left out of searches)."""
    out = {}
    for k in knobs():
        if k.needs == "gpu" and not has_gpu:
            out[k.key] = "needs an NVIDIA GPU; none on this machine"
        elif k.needs == "accelerator" and not has_gpu:
            out[k.key] = "no accelerator: the fast tier and the host are the same memory and cores"
        elif k.needs == "cpu" and has_gpu:
            out[k.key] = "the model runs on the GPU here; this knob acts on the native CPU kernels only"
    return out


def knob_active(cfg: EngineConfig, k: KnobInfo) -> bool:
    """Whether a conditional knob's parents have the values under which it acts."""
    by_name = _knobs_by_name()
    for parent, values in k.when.items():
        p = by_name[parent]
        if getattr(getattr(cfg, p.area), p.name) not in values:
            return False
    return True


def knob_table() -> list[dict[str, Any]]:
    """Rows for ``engine knobs``: key, default, range, search range and meaning."""
    rows = []
    for k in knobs():
        s = k.search
        if s is None:
            search = ""
        elif s.choices is not None:
            search = "|".join(map(str, s.choices))
        else:
            search = f"{_num(s.low)}..{_num(s.high)}" + (" log" if s.log else "")
        when = "; ".join(f"{p} in {'|'.join(map(str, v))}" for p, v in k.when.items())
        rows.append({"knob": k.key, "flag": k.flag, "type": k.type.__name__, "default": k.default,
                     "range": k.range_text(), "search": search, "when": when, "needs": k.needs or "",
                     "doc": k.doc})
    return rows
