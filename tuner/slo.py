"""Service-level objectives: parsing, per-request attainment, goodput and capacity (pure code).

An SLO spec is a set of bounds named from a fixed table (:data:`SLO_METRICS`)::

    ttft_p99_ms=2000  tpot_p99_ms=200  attainment_min=0.9  quality_min=0.95

Definitions (DESIGN.md): a request *meets the SLO* when it finished (not rejected) and its own
TTFT, TPOT and end-to-end latency are within the latency bounds given (for a metric bounded at
several percentiles, the loosest bound). *SLO attainment* is the share of the workload's requests
that meet it (DistServe); *goodput* is the requests per second (and output tokens per second) of
those requests (vLLM ``--goodput``); *capacity* is the highest arrival-rate scale at which
attainment stays at or above the target (DistServe goodput@90), found by bisection.

Each bound is also an aggregate constraint checked on the run's summary (``ttft_p99_ms`` against
the run's p99 TTFT), as a normalised value for Optuna's ``constraints_func``: <= 0 means met.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

LATENCY_METRICS = {
    "ttft": "time to first token",
    "tpot": "time per output token after the first",
    "e2e": "end-to-end latency",
    "itl": "inter-token latency",
}
PER_REQUEST_METRICS = ("ttft", "tpot", "e2e")
SLO_PERCENTILES = (50, 90, 99)
#: The attainment target when latency bounds are given and ``attainment_min`` is not.
DEFAULT_ATTAINMENT = 0.9


class SloError(ValueError):
    """A bad SLO spec; the message is one line naming the bad entry."""


@dataclass(frozen=True)
class SloMetric:
    """One entry of the SLO table: what it bounds and in which direction."""

    name: str
    bound: str  # "max": measured value <= bound; "min": measured value >= bound
    summary_key: str  # the trial-summary key it is checked against
    doc: str
    per_request: str | None = None  # RequestResult property bounded per request
    fraction: bool = False  # a share in (0, 1]


def _table() -> dict[str, SloMetric]:
    t: dict[str, SloMetric] = {}
    for m, doc in LATENCY_METRICS.items():
        for q in SLO_PERCENTILES:
            name = f"{m}_p{q}_ms"
            t[name] = SloMetric(name, "max", f"{m}_ms_p{q}", f"p{q} {doc} in ms at most",
                                per_request=f"{m}_ms" if m in PER_REQUEST_METRICS else None)
    extra = [
        SloMetric("attainment_min", "min", "slo_attainment",
                  "share of requests meeting every per-request latency bound, at least", fraction=True),
        SloMetric("quality_min", "min", "quality_top1_agreement",
                  "next-token top-1 agreement with the full-precision reference, at least", fraction=True),
        SloMetric("quality_kl_max", "max", "quality_mean_kl",
                  "mean KL divergence from the full-precision reference, at most"),
        SloMetric("output_tokens_per_s_min", "min", "output_tokens_per_s", "output tokens per second, at least"),
        SloMetric("requests_per_s_min", "min", "requests_per_s", "finished requests per second, at least"),
        SloMetric("goodput_rps_min", "min", "goodput_rps", "requests per second meeting the SLO, at least"),
    ]
    t.update({m.name: m for m in extra})
    return t


SLO_METRICS: dict[str, SloMetric] = _table()
ALIASES = {"throughput_min": "output_tokens_per_s_min"}

#: The SLO of ``tuner run`` without ``--slo``: interactive chat at reading speed, and next tokens
#: agreeing with the full-precision model at 90 % of positions (bit-widths and routing cuts trade
#: quality for speed).
DEFAULT_SLO = {"ttft_p99_ms": 1000.0, "tpot_p99_ms": 100.0, "quality_min": 0.9}


@dataclass(frozen=True)
class SloSpec:
    """Bounds by canonical metric name (see :data:`SLO_METRICS`)."""

    bounds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, float]:
        return dict(sorted(self.bounds.items()))

    def request_limits_ms(self) -> dict[str, float]:
        """Per-request latency limits ``{"ttft_ms": 2000, ...}``: the loosest bound of each metric."""
        out: dict[str, float] = {}
        for name, value in self.bounds.items():
            attr = SLO_METRICS[name].per_request
            if attr is not None:
                out[attr] = max(out.get(attr, value), value)
        return out

    @property
    def attainment_target(self) -> float | None:
        """The attainment floor: ``attainment_min``, else :data:`DEFAULT_ATTAINMENT` when latency
        bounds exist, else None."""
        if "attainment_min" in self.bounds:
            return self.bounds["attainment_min"]
        return DEFAULT_ATTAINMENT if self.request_limits_ms() else None

    def constraint_names(self) -> list[str]:
        """The constraints a trial is checked against, in a fixed order."""
        names = sorted(self.bounds)
        if self.attainment_target is not None and "attainment_min" not in names:
            names.append("attainment_min")
        return names

    def describe(self) -> str:
        """``ttft_p99_ms<=1000, tpot_p99_ms<=100`` for messages."""
        parts = []
        for name in self.constraint_names():
            m = SLO_METRICS[name]
            value = self.bounds.get(name, self.attainment_target)
            label = name.removesuffix("_min").removesuffix("_max")
            parts.append(f"{label}{'<=' if m.bound == 'max' else '>='}{_fmt(value)}")
        return ", ".join(parts) or "none"


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _check_value(name: str, raw: Any, where: str) -> float:
    if isinstance(raw, bool):
        raise SloError(f"{where}: value {raw!r} is not a number")
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise SloError(f"{where}: value {raw!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise SloError(f"{where}: value {raw!r} must be a finite number > 0")
    if SLO_METRICS[name].fraction and value > 1:
        raise SloError(f"{where}: {name} is a share, between 0 and 1 (got {raw!r})")
    return value


def _canonical(name: str, where: str) -> str:
    name = ALIASES.get(name, name)
    if name not in SLO_METRICS:
        close = difflib.get_close_matches(name, list(SLO_METRICS) + list(ALIASES), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise SloError(f"{where}: unknown SLO metric {name!r}; {hint}known: {', '.join(SLO_METRICS)}")
    return name


def parse_slo(entries: Iterable[str] = (), data: Mapping[str, Any] | None = None) -> SloSpec:
    """Build an SLO spec from ``NAME=VALUE`` strings and/or JSON files, or a mapping.

    An entry without ``=`` names a JSON file holding an object ``{NAME: VALUE}``. Raises
    :class:`SloError` (one line, naming the entry) for an unknown metric, a bad value, a metric
    given twice or an unreadable file.
    """
    bounds: dict[str, float] = {}

    def put(name: str, raw: Any, where: str) -> None:
        name = _canonical(str(name).strip(), where)
        if name in bounds:
            raise SloError(f"{where}: {name} is given twice")
        bounds[name] = _check_value(name, raw, where)

    for entry in entries:
        where = f"--slo {entry!r}"
        if "=" in entry:
            name, _, raw = entry.partition("=")
            put(name, raw.strip(), where)
            continue
        for name, raw in _read_file(entry, where).items():
            put(name, raw, f"{entry}: {name}")
    for name, raw in (data or {}).items():
        put(name, raw, f"SLO {name}")
    return SloSpec(bounds)


def _read_file(path: str, where: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise SloError(f"{where}: expected NAME=VALUE (e.g. ttft_p99_ms=2000) or a JSON file")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise SloError(f"{where}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise SloError(f"{where}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if isinstance(data, dict) and isinstance(data.get("slo"), dict):
        data = data["slo"]  # a `tuner export` file
    if not isinstance(data, dict):
        raise SloError(f"{where}: expected a JSON object of NAME: VALUE")
    return data


# ------------------------------------------------------------------------------ measurement


class RequestLike(Protocol):
    """What SLO checks read from a request (``engine.results.RequestResult`` has it)."""

    request_id: str
    output_tokens: int
    finish_reason: str

    @property
    def ttft_ms(self) -> float | None: ...
    @property
    def tpot_ms(self) -> float | None: ...
    @property
    def e2e_ms(self) -> float | None: ...


def request_meets(r: RequestLike, limits_ms: Mapping[str, float]) -> bool:
    """Whether one request met every per-request latency limit (``{"ttft_ms": 2000, ...}``).

    A rejected or unfinished request never meets it; a one-token request has no TPOT and so
    cannot break a TPOT limit.
    """
    if r.finish_reason in ("rejected", "") or r.e2e_ms is None:
        return False
    for attr, limit in limits_ms.items():
        value = getattr(r, attr)
        if value is None:
            if attr == "tpot_ms":
                continue
            return False
        if value > limit:
            return False
    return True


@dataclass
class SloResult:
    """How one run did against an SLO spec."""

    attainment: float
    goodput_rps: float
    goodput_tokens_per_s: float
    met: dict[str, bool]
    constraints: dict[str, float]
    """Normalised constraint values by name: <= 0 met, > 0 violated by that fraction of the bound."""
    unmeasured: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return all(v <= 0 for v in self.constraints.values())

    def violated(self) -> list[str]:
        return [k for k, v in self.constraints.items() if v > 0]


def constraint_value(bound: str, measured: float, limit: float) -> float:
    """Normalised violation: ``measured/limit - 1`` for an upper bound, ``1 - measured/limit`` for a
    lower one (<= 0 when met)."""
    if bound == "max":
        return measured / limit - 1.0
    return 1.0 - measured / limit


def evaluate(requests: Sequence[RequestLike], summary: Mapping[str, Any], duration_s: float,
             slo: SloSpec) -> SloResult:
    """Attainment, goodput and constraint values of one run.

    ``summary`` is ``RunResult.summary()`` (percentiles under ``ttft_ms_p99``-style keys). Bounds on
    figures the run did not measure (quality without a reference run) are listed in
    ``unmeasured`` and count as met; latency percentiles missing because nothing finished count
    as violated.
    """
    limits = slo.request_limits_ms()
    met = {r.request_id: request_meets(r, limits) for r in requests}
    met_requests = [r for r in requests if met[r.request_id]]
    n = len(requests)
    attainment = len(met_requests) / n if n else 0.0
    goodput_rps = len(met_requests) / duration_s if duration_s > 0 else 0.0
    goodput_tps = sum(r.output_tokens for r in met_requests) / duration_s if duration_s > 0 else 0.0
    figures = {**summary, "slo_attainment": attainment, "goodput_rps": goodput_rps}
    any_done = any(r.finish_reason not in ("rejected", "") for r in requests)
    constraints: dict[str, float] = {}
    unmeasured: list[str] = []
    for name in slo.constraint_names():
        m = SLO_METRICS[name]
        limit = slo.bounds.get(name)
        if name == "attainment_min" and limit is None:
            limit = slo.attainment_target
        assert limit is not None
        value = figures.get(m.summary_key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            if name.startswith("quality"):
                unmeasured.append(name)
                constraints[name] = 0.0
            elif m.per_request == "tpot_ms" and any_done:
                constraints[name] = 0.0  # only one-token replies: no TPOT to bound
            else:
                constraints[name] = 1.0
            continue
        constraints[name] = constraint_value(m.bound, float(value), limit)
    if unmeasured:
        log.debug("SLO bounds %s not checked: the run did not measure them", ", ".join(unmeasured))
    return SloResult(attainment, goodput_rps, goodput_tps, met, constraints, unmeasured)


# --------------------------------------------------------------------------- early stopping


@dataclass
class Progress:
    """A request seen part-way through a run; times in seconds, from the run's start, as lower
    bounds (``first_token_s``/``finish_s`` None while not reached)."""

    arrival_s: float
    first_token_s: float | None = None
    finish_s: float | None = None
    output_tokens: int = 0
    rejected: bool = False


def certain_misses(progress: Iterable[Progress], now_s: float, limits_ms: Mapping[str, float]) -> int:
    """How many requests have already missed a per-request limit, whatever happens next.

    ``now_s`` and every time in ``progress`` must be lower bounds of the true elapsed times on
    the run's clock, so that a miss counted here is a miss in the final result. TPOT is checked
    only for finished requests.
    """
    ttft = limits_ms.get("ttft_ms", math.inf) / 1e3
    e2e = limits_ms.get("e2e_ms", math.inf) / 1e3
    tpot = limits_ms.get("tpot_ms", math.inf) / 1e3
    misses = 0
    for p in progress:
        if p.rejected:
            misses += 1
            continue
        first_wait = (p.first_token_s if p.first_token_s is not None else now_s) - p.arrival_s
        end_wait = (p.finish_s if p.finish_s is not None else now_s) - p.arrival_s
        missed = first_wait > ttft or end_wait > e2e
        if not missed and p.finish_s is not None and p.first_token_s is not None and p.output_tokens >= 2:
            missed = (p.finish_s - p.first_token_s) / (p.output_tokens - 1) > tpot
        misses += missed
    return misses


def target_unreachable(n_requests: int, n_misses: int, target: float | None) -> bool:
    """Whether ``n_misses`` certain misses already put attainment below ``target`` for good."""
    if target is None or n_requests <= 0:
        return False
    return (n_requests - n_misses) / n_requests < target


# --------------------------------------------------------------------------------- capacity


@dataclass
class Capacity:
    """The highest rate scale found with attainment >= target, and every probe made."""

    rate_scale: float
    probes: list[tuple[float, float]]  # (rate_scale, attainment) in the order run
    bounded: bool  # False when even the highest probe met the target (capacity is at least this)


def find_capacity(attainment_at: Callable[[float], float], target: float, start_rate_scale: float = 1.0,
                  *, max_probes: int = 8, rel_tol: float = 0.15, min_rate_scale: float = 1 / 64) -> Capacity:
    """Bisect over the arrival-rate scale for the highest one keeping attainment >= ``target``.

    Doubles (or halves) from ``start_rate_scale`` until the target is crossed, then bisects on a
    log scale until the bracket is within ``rel_tol`` or ``max_probes`` runs were made. Returns
    rate scale 0 when even ``min_rate_scale`` misses the target.
    """
    probes: list[tuple[float, float]] = []

    def ok(scale: float) -> bool:
        a = attainment_at(scale)
        probes.append((scale, a))
        return a >= target

    # Bracket [lo, hi]: lo met the target, hi did not.
    if ok(start_rate_scale):
        lo = start_rate_scale
        while True:
            if len(probes) >= max_probes:
                return Capacity(lo, probes, bounded=False)
            if not ok(lo * 2):
                hi = lo * 2
                break
            lo *= 2
    else:
        hi = start_rate_scale
        while True:
            if len(probes) >= max_probes or hi / 2 < min_rate_scale:
                return Capacity(0.0, probes, bounded=True)
            if ok(hi / 2):
                lo = hi / 2
                break
            hi /= 2
    while hi / lo > 1 + rel_tol and len(probes) < max_probes:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return Capacity(lo, probes, bounded=True)
