"""What a run measured: per request, per step, per expert, telemetry, and the summary.

Metric definitions follow DESIGN.md: TTFT is arrival to first token; TPOT is
(end-to-end - TTFT) / (output tokens - 1), the first token excluded (vLLM's definition);
ITL are the gaps between consecutive tokens of one request.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from engine.metrics import PERCENTILES, latency_name


@dataclass
class RequestResult:
    """One request's timeline. Times are seconds from the start of the run."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    first_token_s: float | None
    finish_s: float | None
    itl_ms: list[float]
    finish_reason: str  # "length" | "eos" | "rejected" | "" (unfinished: the run was stopped early)
    tag: str | None = None
    output_ids: list[int] = field(default_factory=list)

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_s is None else (self.first_token_s - self.arrival_s) * 1e3

    @property
    def e2e_ms(self) -> float | None:
        return None if self.finish_s is None else (self.finish_s - self.arrival_s) * 1e3

    @property
    def tpot_ms(self) -> float | None:
        if self.output_tokens < 2 or self.finish_s is None or self.first_token_s is None:
            return None
        return (self.finish_s - self.first_token_s) * 1e3 / (self.output_tokens - 1)

    def to_dict(self, with_ids: bool = False) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not with_ids:
            d.pop("output_ids")
        d.update(ttft_ms=self.ttft_ms, tpot_ms=self.tpot_ms, e2e_ms=self.e2e_ms)
        return d


@dataclass
class StepRecord:
    """One engine step (one forward pass over the scheduled batch)."""

    step: int
    start_s: float
    duration_ms: float
    batch_seqs: int
    prefill_tokens: int
    decode_tokens: int
    ep_bytes_dispatched: int | None = None
    """Expert parallelism (None with one rank): bytes the step's MoE layers dispatched and combined
    between ranks, and the mean over its MoE layers of max/mean pairs per rank."""
    ep_bytes_combined: int | None = None
    ep_imbalance: float | None = None


@dataclass
class TelemetrySample:
    """Process and device readings at ``t_s`` seconds from the start of the run."""

    t_s: float
    cpu_percent: float
    rss_bytes: int
    gpu_util_percent: float | None = None
    gpu_mem_bytes: int | None = None
    gpu_power_w: float | None = None


@dataclass
class ExpertStat:
    """Tokens routed to one expert of one MoE layer during the run."""

    layer: int
    expert: int
    tokens: int
    resident: bool = True
    precision: str = ""
    replicas: int = 0


class ExpertStats(Sequence[ExpertStat]):
    """A run's :class:`ExpertStat` records, made by ``build`` when first read: a stub or simulated run
    holds one per expert of every MoE layer (thousands) and a tuner's capacity search reads those of
    its best run only. Reads, compares and pickles as the list ``build`` returns."""

    def __init__(self, build: Callable[[], list[ExpertStat]]) -> None:
        self._build: Callable[[], list[ExpertStat]] | None = build
        self._items: list[ExpertStat] = []

    def _list(self) -> list[ExpertStat]:
        if self._build is not None:
            self._items, self._build = self._build(), None
        return self._items

    def __len__(self) -> int:
        return len(self._list())

    @overload
    def __getitem__(self, i: int) -> ExpertStat: ...

    @overload
    def __getitem__(self, i: slice) -> list[ExpertStat]: ...

    def __getitem__(self, i: int | slice) -> ExpertStat | list[ExpertStat]:
        return self._list()[i]

    def __iter__(self) -> Iterator[ExpertStat]:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ExpertStats):
            other = other._list()
        return self._list() == other if isinstance(other, list) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._list())

    def __reduce__(self) -> tuple[Any, ...]:
        return list, (self._list(),)


def _flat_dicts(records: Sequence[Any]) -> list[dict[str, Any]]:
    """``dataclasses.asdict`` of each record of a dataclass whose fields hold plain values (numbers,
    strings, None), without asdict's deep copy of each value (a run holds one per expert per layer)."""
    if not records:
        return []
    names = [f.name for f in dataclasses.fields(records[0])]
    return [{n: getattr(r, n) for n in names} for r in records]


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class RunResult:
    """Everything one run measured, plus what it ran (model, config, hardware, software)."""

    meta: dict[str, Any]
    requests: list[RequestResult]
    steps: list[StepRecord]
    telemetry: list[TelemetrySample]
    expert_stats: Sequence[ExpertStat]  # a list, or ExpertStats made when first read
    duration_s: float
    peak_rss_bytes: int
    peak_device_mem_bytes: int | None = None
    quality: dict[str, float] | None = None
    decisions: list[dict[str, Any]] | None = None
    """The plan of every step and MoE layer when the run kept them (``engine run --decisions``)."""

    def summary(self) -> dict[str, Any]:
        """Totals and percentiles under the names of ``engine.metrics.METRICS`` (``ttft_p99_ms``)."""
        done = [r for r in self.requests if r.finish_reason not in ("rejected", "")]  # "": a run stopped early
        out_tokens = sum(r.output_tokens for r in done)
        s: dict[str, Any] = {
            "requests": len(self.requests),
            "requests_done": len(done),
            "requests_rejected": sum(r.finish_reason == "rejected" for r in self.requests),
            "requests_unfinished": sum(r.finish_reason == "" for r in self.requests),
            "prompt_tokens": sum(r.prompt_tokens for r in done),
            "output_tokens": out_tokens,
            "duration_s": self.duration_s,
            "output_tokens_per_s": out_tokens / self.duration_s if self.duration_s > 0 else 0.0,
            "requests_per_s": len(done) / self.duration_s if self.duration_s > 0 else 0.0,
            "steps": len(self.steps),
            "peak_rss_bytes": self.peak_rss_bytes,
            "peak_device_mem_bytes": self.peak_device_mem_bytes,
        }
        series = {
            "ttft": [r.ttft_ms for r in done],
            "tpot": [r.tpot_ms for r in done],
            "e2e": [r.e2e_ms for r in done],
            "itl": [x for r in done for x in r.itl_ms],
        }
        for name, vals in series.items():
            clean = [v for v in vals if v is not None]
            s[latency_name(name)] = sum(clean) / len(clean) if clean else None
            for q in PERCENTILES:
                s[latency_name(name, q)] = percentile(clean, q)
        if self.quality:
            s.update({f"quality_{k}": v for k, v in self.quality.items()})
        ep = (self.meta or {}).get("ep")
        if ep:
            s.update(ep_ranks=ep["ranks"], ep_imbalance_mean=ep["imbalance_mean"], ep_imbalance_max=ep["imbalance_max"],
                     ep_bytes_dispatched_per_step=ep["bytes_dispatched_per_step_mean"],
                     ep_bytes_combined_per_step=ep["bytes_combined_per_step_mean"])
        return s

    def to_dict(self, with_ids: bool = False) -> dict[str, Any]:
        out = {
            "meta": self.meta,
            "summary": self.summary(),
            "requests": [r.to_dict(with_ids) for r in self.requests],
            "steps": _flat_dicts(self.steps),
            "telemetry": _flat_dicts(self.telemetry),
            "expert_stats": _flat_dicts(self.expert_stats),
        }
        if self.decisions is not None:
            out["decisions"] = self.decisions
        return out
