"""The one table of metric names: what a run reports, what SLOs bound, what the database stores.

Names put the unit last (``ttft_p99_ms``, ``output_tokens_per_s``, ``peak_rss_bytes``). Run summaries
(``engine.results.RunResult.summary``), SLO bounds (``tuner.slo``), objectives (``tuner.metrics``),
the ``mt_trials`` columns (``db``), ``tuner show`` and the dashboard's labels all read this table;
nothing else spells a metric × percentile list.

Older spellings (``ttft_ms_p99``, units before the percentile, as summaries stored before this table
had them) are still read where a user or an old database may hand them in: :func:`canonical` maps
them, :func:`read` finds a value under either spelling. Plain data, no torch.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Per-request latency series: name -> what it measures (DESIGN.md's definitions).
LATENCIES: dict[str, str] = {
    "ttft": "time to first token (arrival to first token)",
    "tpot": "time per output token after the first",
    "e2e": "end-to-end latency",
    "itl": "inter-token latency",
}
#: Latencies that exist once per request (``RequestResult.ttft_ms``...); ITL has many per request.
PER_REQUEST = ("ttft", "tpot", "e2e")
PERCENTILES = (50, 90, 99)


class MetricError(ValueError):
    """An unknown metric name; one line that names it and suggests the closest known one."""


@dataclass(frozen=True)
class Metric:
    """One row of the table."""

    name: str
    unit: str  # "ms", "s", "tokens/s", "req/s", "share", "bytes", "count", "nats", "ratio"
    label: str  # for axes and tables
    doc: str
    direction: str | None = None  # "maximize" | "minimize" for figures worth optimising
    series: str | None = None  # latency series ("ttft") for latency percentiles and means
    percentile: int | None = None
    column: bool = False  # also an ``mt_trials`` column
    integer: bool = False  # stored as an integer (bytes, counts)

    @property
    def per_request(self) -> str | None:
        """The ``RequestResult`` property a per-request bound checks (``ttft_ms``), or None."""
        return f"{self.series}_ms" if self.series in PER_REQUEST else None


def latency_name(series: str, percentile: int | None = None) -> str:
    """``("ttft", 99)`` -> ``ttft_p99_ms``; ``("ttft", None)`` -> ``ttft_mean_ms``."""
    return f"{series}_{'mean' if percentile is None else f'p{percentile}'}_ms"


def _table() -> dict[str, Metric]:
    rows = [
        Metric("requests", "count", "requests", "requests in the run", integer=True),
        Metric("requests_done", "count", "requests done", "requests that finished (not rejected)", integer=True),
        Metric("requests_rejected", "count", "requests rejected", "requests the engine refused", integer=True),
        Metric("requests_unfinished", "count", "requests unfinished",
               "requests still running when the run was stopped early", integer=True),
        Metric("prompt_tokens", "count", "prompt tokens", "prompt tokens of finished requests", integer=True),
        Metric("output_tokens", "count", "output tokens", "output tokens of finished requests", integer=True),
        Metric("steps", "count", "steps", "engine steps (forward passes)", integer=True),
        Metric("duration_s", "s", "duration (s)", "wall time of the run", column=True),
        Metric("output_tokens_per_s", "tokens/s", "throughput (output tok/s)", "output tokens per second",
               "maximize", column=True),
        Metric("requests_per_s", "req/s", "requests/s", "finished requests per second", "maximize", column=True),
        Metric("peak_rss_bytes", "bytes", "peak RSS (bytes)", "peak resident memory of the process", "minimize",
               column=True, integer=True),
        Metric("peak_device_mem_bytes", "bytes", "peak device memory (bytes)", "peak accelerator memory",
               "minimize", column=True, integer=True),
        Metric("quality_top1_agreement", "share", "top-1 agreement",
               "next-token top-1 agreement with the full-precision reference", "maximize", column=True),
        Metric("quality_mean_kl", "nats", "mean KL", "mean KL divergence from the full-precision reference",
               "minimize", column=True),
        Metric("slo_attainment", "share", "SLO attainment", "share of requests meeting every per-request bound",
               "maximize", column=True),
        Metric("goodput_rps", "req/s", "goodput (req/s)", "requests per second meeting every bound", "maximize",
               column=True),
        Metric("goodput_tokens_per_s", "tokens/s", "goodput (tok/s)",
               "output tokens per second of requests meeting every bound", "maximize"),
        Metric("capacity_rps", "req/s", "capacity (req/s)",
               "highest arrival rate at which SLO attainment stays at or above the target", "maximize", column=True),
        # Expert parallelism (absent with one rank): from the run's ``meta["ep"]``, the same for both backends.
        Metric("ep_ranks", "count", "EP ranks", "expert-parallel ranks the experts are split across", column=True,
               integer=True),
        Metric("ep_imbalance_mean", "ratio", "EP imbalance (mean)",
               "max/mean routed pairs per rank, per MoE layer over the run, averaged over layers", "minimize",
               column=True),
        Metric("ep_imbalance_max", "ratio", "EP imbalance (max)",
               "max/mean routed pairs per rank of the most imbalanced MoE layer over the run", "minimize",
               column=True),
        Metric("ep_bytes_dispatched_per_step", "bytes", "EP bytes dispatched/step",
               "bytes sent to other ranks before the experts, per step (mean)", "minimize", column=True),
        Metric("ep_bytes_combined_per_step", "bytes", "EP bytes combined/step",
               "bytes exchanged between ranks to combine the experts' outputs, per step (mean)", "minimize",
               column=True),
    ]
    for series, doc in LATENCIES.items():
        rows.append(Metric(latency_name(series), "ms", f"{series.upper()} mean (ms)", f"mean {doc}", "minimize",
                           series=series))
        for q in PERCENTILES:
            rows.append(Metric(latency_name(series, q), "ms", f"{series.upper()} p{q} (ms)", f"p{q} {doc}",
                               "minimize", series=series, percentile=q, column=True))
    return {m.name: m for m in rows}


METRICS: dict[str, Metric] = _table()


def _legacy_names() -> dict[str, str]:
    # The summaries' old spelling put the unit before the percentile: ttft_ms_p99, ttft_ms_mean.
    out = {}
    for m in METRICS.values():
        if m.series is not None:
            out[f"{m.series}_ms_{'mean' if m.percentile is None else f'p{m.percentile}'}"] = m.name
    return out


#: Old spelling -> name.
LEGACY: dict[str, str] = _legacy_names()


def canonical(name: str, where: str = "metric") -> str:
    """The table's name for ``name`` (an old spelling is accepted), or a one-line :class:`MetricError`."""
    name = str(name).strip()
    if name in METRICS:
        return name
    if name in LEGACY:
        return LEGACY[name]
    close = difflib.get_close_matches(name, list(METRICS), n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise MetricError(f"{where}: unknown metric {name!r}{hint}")


def read(data: Mapping[str, Any] | None, name: str) -> Any:
    """``data[name]``, else the value under its old spelling (summaries stored before this table)."""
    if not data:
        return None
    if name in data:
        return data[name]
    for old, new in LEGACY.items():
        if new == name and old in data:
            return data[old]
    return None


def column_metrics() -> list[Metric]:
    """Metrics stored as ``mt_trials`` columns, in table order."""
    return [m for m in METRICS.values() if m.column]


def latency_percentiles(series: str | None = None) -> list[Metric]:
    """Latency percentile metrics (of one series, or all), in table order."""
    return [m for m in METRICS.values() if m.percentile is not None and (series is None or m.series == series)]


def label(name: str) -> str:
    """A readable label (``TTFT p99 (ms)``) for a metric name, else the name itself."""
    m = METRICS.get(name) or METRICS.get(LEGACY.get(name, ""))
    return m.label if m is not None else name


def finite_or_none(x: Any) -> float | None:
    """``x`` as a float, None for missing or NaN."""
    if x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v
