"""Service-level objectives: parsing, per-request attainment, goodput, early verdicts (pure code).

An SLO spec is a set of bounds named from a fixed table (:data:`SLO_METRICS`)::

    ttft_p99_ms=2000  tpot_p99_ms=200  attainment_min=0.9  quality_min=0.95

Definitions (DESIGN.md): a request *meets the SLO* when it finished (not rejected) and its own
TTFT, TPOT and end-to-end latency are within the latency bounds given (for a metric bounded at
several percentiles, the loosest bound). *SLO attainment* is the share of the workload's requests
that meet it (DistServe); *goodput* is the requests per second (and output tokens per second) of
those requests (vLLM ``--goodput``); *capacity* is the highest arrival-rate scale at which
attainment stays at or above the target (DistServe goodput@90), searched by ``tuner.capacity``.

Each bound is also an aggregate constraint checked on the run's summary (``ttft_p99_ms`` against
the run's p99 TTFT), as a normalised value for Optuna's ``constraints_func``: <= 0 means met.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from engine.metrics import LEGACY, METRICS, latency_percentiles
from engine.metrics import read as read_metric

log = logging.getLogger(__name__)

#: The attainment target when latency bounds are given and ``attainment_min`` is not.
DEFAULT_ATTAINMENT = 0.9


class SloError(ValueError):
    """A bad SLO spec; the message is one line naming the bad entry."""


@dataclass(frozen=True)
class SloMetric:
    """One entry of the SLO table: what it bounds and in which direction."""

    name: str
    bound: str  # "max": measured value <= bound; "min": measured value >= bound
    summary_key: str  # the run-summary metric (``engine.metrics.METRICS``) it is checked against
    doc: str
    per_request: str | None = None  # RequestResult property bounded per request
    fraction: bool = False  # a share in (0, 1]


def _table() -> dict[str, SloMetric]:
    # Every latency percentile of the metrics table is an upper bound; a few totals are lower bounds.
    t: dict[str, SloMetric] = {
        m.name: SloMetric(m.name, "max", m.name, f"{m.doc} in ms, at most", per_request=m.per_request)
        for m in latency_percentiles()}
    lower = {"attainment_min": "slo_attainment", "quality_min": "quality_top1_agreement",
             "output_tokens_per_s_min": "output_tokens_per_s", "requests_per_s_min": "requests_per_s",
             "goodput_rps_min": "goodput_rps"}
    for name, key in lower.items():
        m = METRICS[key]
        t[name] = SloMetric(name, "min", key, f"{m.doc}, at least", fraction=m.unit == "share")
    t["quality_kl_max"] = SloMetric("quality_kl_max", "max", "quality_mean_kl",
                                    f"{METRICS['quality_mean_kl'].doc}, at most")
    return t


SLO_METRICS: dict[str, SloMetric] = _table()


def latency_bound(name: str) -> bool:
    """Whether a bound depends on request latencies (a percentile, the attainment floor, goodput)."""
    m = SLO_METRICS[name]
    return name in ("attainment_min", "goodput_rps_min") or METRICS[m.summary_key].series is not None


#: Other spellings a user may type: ``throughput_min``, and the summaries' old ``ttft_ms_p99`` order.
ALIASES = {"throughput_min": "output_tokens_per_s_min",
           **{old: new for old, new in LEGACY.items() if new in SLO_METRICS}}

#: The SLO of ``tuner run`` without ``--slo``: interactive chat, a first token within 1 s and then 10
#: tokens/s or faster (MLPerf Inference's server scenario asks 2 s and 200 ms of Llama-2-70B, its
#: interactive one 450 ms and 40 ms), and next tokens agreeing with the full-precision model at 90 % of
#: positions (bit-widths and routing cuts trade quality for speed). At 2 s and 200 ms every config met
#: the built-in ``quick`` workload even as one burst on an idle 2-core CPU, so all tied at the capacity
#: search's ceiling; at 1 s and 100 ms the defaults reach 16-19 req/s there, llama.cpp-like 7 and
#: hf-static-like 0.
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

    def constraint_names(self, latency: bool = True) -> list[str]:
        """The constraints a trial is checked against, in a fixed order.

        ``latency=False`` leaves out the per-request latency bounds and the attainment floor: under the
        capacity objective they define the knee (the rate is what is measured), and an offline replay
        has no arrival times for them to mean anything.
        """
        if not latency:
            return sorted(n for n in self.bounds if not latency_bound(n))
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

    def describe_latency(self) -> str:
        """``ttft<=1000 ms, tpot<=100 ms``: the per-request limits a request must meet."""
        return ", ".join(f"{k.removesuffix('_ms')}<={_fmt(v)} ms" for k, v in self.request_limits_ms().items()) \
            or "none"


def study_constraints(slo: SloSpec, *, capacity: bool, latency: bool) -> list[str]:
    """The constraints of a study's trials, in a fixed order (Optuna needs the same for every trial).

    Capacity: the bounds that do not depend on latency, plus the attainment floor checked at the
    highest rate that met it (violated only when no rate did). ``latency``: every bound. Otherwise
    (an offline replay): the bounds that do not depend on latency, such as the quality floor.
    """
    if capacity:
        names = slo.constraint_names(latency=False)
        return names + ["attainment_min"] if slo.attainment_target is not None else names
    return slo.constraint_names(latency=latency)


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
        close = difflib.get_close_matches(name, list(SLO_METRICS), n=1)
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
             slo: SloSpec, constraints: Sequence[str] | None = None) -> SloResult:
    """Attainment, goodput and constraint values of one run.

    ``summary`` is ``RunResult.summary()`` (``engine.metrics`` names; old spellings are read too).
    ``constraints`` names the bounds to check (default :meth:`SloSpec.constraint_names`; see
    :func:`study_constraints`). Bounds on figures the run did not measure (quality without a reference
    run) are listed in ``unmeasured`` and count as met; latency percentiles missing because nothing
    finished count as violated.
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
    names = slo.constraint_names() if constraints is None else list(constraints)
    values: dict[str, float] = {}
    unmeasured: list[str] = []
    for name in names:
        m = SLO_METRICS[name]
        limit = slo.bounds.get(name)
        if name == "attainment_min" and limit is None:
            limit = slo.attainment_target
        assert limit is not None
        value = read_metric(figures, m.summary_key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            if name.startswith("quality"):
                unmeasured.append(name)
                values[name] = 0.0
            elif m.per_request == "tpot_ms" and any_done:
                values[name] = 0.0  # only one-token replies: no TPOT to bound
            else:
                values[name] = 1.0
            continue
        values[name] = constraint_value(m.bound, float(value), limit)
    if unmeasured:
        log.debug("SLO bounds %s not checked: the run did not measure them", ", ".join(unmeasured))
    return SloResult(attainment, goodput_rps, goodput_tps, met, values, unmeasured)


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
    max_new_tokens: int | None = None
    """The most tokens the request may produce (its TPOT is at least the time so far over that many gaps)."""


def certain_misses(progress: Iterable[Progress], now_s: float, limits_ms: Mapping[str, float]) -> int:
    """How many requests have already missed a per-request limit, whatever happens next.

    ``now_s`` and every time in ``progress`` must be lower bounds of the true elapsed times on
    the run's clock, so that a miss counted here is a miss in the final result. A request still
    decoding has a TPOT of at least (now - first token) / (max_new_tokens - 1), whatever comes next.
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
        if not missed and p.first_token_s is not None:
            if p.finish_s is not None:
                if p.output_tokens >= 2:
                    missed = (p.finish_s - p.first_token_s) / (p.output_tokens - 1) > tpot
            elif p.max_new_tokens is not None and p.max_new_tokens >= 2:
                missed = (now_s - p.first_token_s) / (p.max_new_tokens - 1) > tpot
        misses += missed
    return misses


def target_unreachable(n_requests: int, n_misses: int, target: float | None) -> bool:
    """Whether ``n_misses`` certain misses already put attainment below ``target`` for good."""
    if target is None or n_requests <= 0:
        return False
    return (n_requests - n_misses) / n_requests < target


#: A finished request counts as a certain meet only this far inside every limit: the watcher's
#: clock may run a little behind the runner's (see ``tuner.watch``).
MEET_SLACK = 0.98


def certain_meets(progress: Iterable[Progress], limits_ms: Mapping[str, float]) -> int:
    """How many finished requests met every per-request limit with room to spare (:data:`MEET_SLACK`).

    Only finished requests count; the final verdict always comes from :func:`evaluate` on the run's
    own figures, so a request this counts and the run does not (a hair over a limit) costs a probe its
    early stop, never a wrong result.
    """
    ttft = limits_ms.get("ttft_ms", math.inf) / 1e3 * MEET_SLACK
    e2e = limits_ms.get("e2e_ms", math.inf) / 1e3 * MEET_SLACK
    tpot = limits_ms.get("tpot_ms", math.inf) / 1e3 * MEET_SLACK
    meets = 0
    for p in progress:
        if p.rejected or p.finish_s is None or p.first_token_s is None:
            continue
        ok = p.first_token_s - p.arrival_s <= ttft and p.finish_s - p.arrival_s <= e2e
        if ok and p.output_tokens >= 2:
            ok = (p.finish_s - p.first_token_s) / (p.output_tokens - 1) <= tpot
        meets += ok
    return meets


def target_certain(n_requests: int, n_meets: int, target: float | None) -> bool:
    """Whether ``n_meets`` certain meets already put attainment at or above ``target`` for good."""
    if target is None or n_requests <= 0:
        return False
    return n_meets / n_requests >= target
