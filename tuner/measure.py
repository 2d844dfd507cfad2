"""Measuring one config: the objective's value from replays of (a prefix of) the workload.

- ``capacity_rps`` (the default objective): probes at rising or falling arrival rates
  (:func:`tuner.capacity.find_capacity`), each replay stopped as soon as its verdict against the
  attainment target is certain (:class:`tuner.watch.SloWatch`); the value is the knee in requests/s.
- any other objective: one replay (offline: every request at t=0; realtime: the recorded arrival
  times divided by ``rate_scale``), optionally stopped once the SLO can no longer be met.

*Fidelity* is the share of the workload's requests a measurement replays (a prefix, at least
:data:`MIN_REQUESTS`): the multi-fidelity search measures most configs on a short prefix first.

Time is accounted honestly: ``runs_s`` is the replays' own duration; everything else in ``wall_s``
(preparing and evaluating replays) is overhead, and so are the reconfiguration and warm-up that
:meth:`Measurer.apply` reports.

Replays run through the step interface (:mod:`engine.backend`): the measurer holds a backend
(``engine.backend.make_backend``), and the early stop is the runner's ``on_progress`` callback.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.backend import Backend, as_backend, make_backend
from engine.config import EngineConfig
from engine.results import RunResult
from engine.runner import run_workload
from engine.runtime import Engine, is_plain, weights_key
from tuner import capacity as cap
from tuner.metrics import trial_metrics
from tuner.slo import SloResult, SloSpec, evaluate
from tuner.watch import SloWatch
from workloads.transform import cycle

log = logging.getLogger(__name__)

CAPACITY = "capacity_rps"
#: The shortest prefix a measurement replays: below this a 90 % attainment target is all or nothing.
MIN_REQUESTS = 8
#: Requests replayed (offline, unrecorded) after a change of weights or expert path, before measuring,
#: each cut to :data:`WARM_UP_NEW_TOKENS` new tokens: a prefill and a few decode steps reach every first-use
#: cost (allocator, kernel selection, a new weight layout); decoding the whole answer was most of a
#: trial's overhead on a slow config (1.0-1.9 s of 2 s here).
WARM_UP_REQUESTS = 1
WARM_UP_NEW_TOKENS = 4
#: The shortest arrival span of a capacity probe of the whole workload, in seconds (of a prefix: that share
#: of it). Where a probe's rate brings the requests in faster, it replays them again
#: (``workloads.transform.cycle``: copies one period later) until they span this long, so that a probe
#: loads the engine steadily instead of sending one burst a fast config absorbs whole (with 48 requests
#: and no cycling, every config on an AVX512_BF16 CPU met a 1 s / 100 ms SLO at the search's ceiling).
#: MLPerf's loadgen repeats its sample set to a minimum duration the same way.
MIN_PROBE_S = 2.0
#: The most requests one probe replays, copies included: the highest rate a capacity search tries is this
#: many arriving over ``MIN_PROBE_S`` (about 1000 req/s on the whole workload).
MAX_PROBE_REQUESTS = 2048


@dataclass(frozen=True)
class MeasureSettings:
    """How a study measures: the same for every config (stored with the study)."""

    objectives: tuple[str, ...]
    mode: str = "realtime"
    rate_scale: float = 1.0
    """Arrival-rate scale of single replays; the first guess of a capacity search."""
    max_requests: int | None = None
    constraints: tuple[str, ...] = ()
    """The SLO bounds a replay is checked against (``tuner.slo.study_constraints``)."""
    rel_tol: float = cap.REL_TOL
    max_probes: int = cap.MAX_PROBES
    floor_ratio: float = cap.MIN_RATE_SCALE
    """The lowest rate a capacity search probes, as a share of the rate it starts from (the best capacity so
    far): a config that misses there is reported as 0, "far below the best", rather than searched in probes
    that last ever longer (a probe at rate scale s lasts 1/s of the recorded span)."""

    @property
    def capacity(self) -> bool:
        return self.objectives[0] == CAPACITY

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MeasureSettings:
        """The settings a study stored (``to_dict``); keys it lacks take today's defaults."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names}
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {"objectives": list(self.objectives), "mode": self.mode, "rate_scale": self.rate_scale,
                "max_requests": self.max_requests, "constraints": list(self.constraints),
                "rel_tol": self.rel_tol, "max_probes": self.max_probes, "floor_ratio": self.floor_ratio}


@dataclass
class Replay:
    """One replay (a capacity probe, or the single run of another objective) and its verdict."""

    rate_scale: float
    rate_rps: float | None
    n_requests: int
    """Requests replayed, copies included (``workloads.transform.cycle``)."""
    result: RunResult
    slo: SloResult
    summary: dict[str, Any]
    met: bool
    stopped: str | None = None
    """``"met"``/``"missed"`` when the replay was stopped once its verdict was certain."""
    reason: str = ""
    prefix_n: int = 0
    """The workload's requests it replays (its first ``prefix_n``; 0: ``n_requests``), whose arrivals give the
    rate scale's requests/s."""

    @property
    def duration_s(self) -> float:
        return self.result.duration_s

    def row(self) -> dict[str, Any]:
        """What ``mt_probes`` keeps of it."""
        return {"rate_scale": self.rate_scale, "rate_rps": self.rate_rps, "attainment": self.slo.attainment,
                "met": self.met, "stopped": self.stopped is not None, "n_requests": self.n_requests,
                "duration_s": self.duration_s, "goodput_rps": self.slo.goodput_rps,
                "ttft_p99_ms": self.summary.get("ttft_p99_ms"), "tpot_p99_ms": self.summary.get("tpot_p99_ms")}


@dataclass
class Measurement:
    """The value of one config at one fidelity, with every replay it took."""

    objectives: tuple[str, ...]
    values: list[float] | None
    """One value per objective; None when not measured (a search stopped early, an unmeasured figure)."""
    fidelity: float
    n_requests: int
    replays: list[Replay] = field(default_factory=list)
    best: Replay | None = None
    """The replay that stands for the config: the highest rate that met the target (capacity), or the run."""
    capacity: cap.Capacity | None = None
    stopped_early: bool = False
    reason: str = ""
    wall_s: float = 0.0

    @property
    def value(self) -> float | None:
        return None if self.values is None else self.values[0]

    @property
    def runs_s(self) -> float:
        return sum(r.duration_s for r in self.replays)

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.wall_s - self.runs_s)

    @property
    def upper_bound(self) -> float | None:
        """For a capacity search stopped early: the rate (req/s) it missed at."""
        if self.capacity is None or not self.stopped_early or not self.replays:
            return None
        return self.replays[-1].rate_rps


class Measurer:
    """Holds the backend of a worker and measures configs on it (one per process).

    ``backend``: a :class:`~engine.backend.Backend` (an :class:`~engine.runtime.Engine` is taken as
    the live one)."""

    def __init__(self, backend: Backend | Engine, workload: Any, slo: SloSpec, settings: MeasureSettings) -> None:
        self.backend: Backend = as_backend(backend)
        self.workload = workload
        self.slo = slo
        self.settings = settings
        self._warm_key: tuple[Any, ...] | None = None
        self._cycled: dict[str, Any] = {}  # the last cycled workload (probes of a search reuse it)

    @property
    def engine(self) -> Engine:
        """The torch engine behind the live backend (quality checks and memory estimates read it)."""
        engine = getattr(self.backend, "engine", None)
        if not isinstance(engine, Engine):
            raise ValueError(f"the {self.backend.kind} backend has no torch engine: quality checks and memory "
                             "estimates need the live one")
        return engine

    # ------------------------------------------------------------------------------ the workload
    def n_requests(self, fidelity: float) -> int:
        """Requests replayed at ``fidelity``: that share of the (``--max-requests``) workload, at least
        :data:`MIN_REQUESTS`."""
        total = len(self.workload.requests)
        if self.settings.max_requests:
            total = min(total, self.settings.max_requests)
        return min(total, max(MIN_REQUESTS, math.ceil(fidelity * total)))

    def base_rate(self, n: int) -> float | None:
        """Requests/s of the first ``n`` requests at rate scale 1 (None: they all arrive at once)."""
        arrivals = [r.arrival_s for r in list(self.workload.requests)[:n]]
        span_s = max(arrivals) - min(arrivals) if arrivals else 0.0
        return (len(arrivals) - 1) / span_s if span_s > 0 else None

    # ------------------------------------------------------------------------------ the engine
    def apply(self, config: EngineConfig, fresh: bool = False) -> dict[str, float]:
        """Reconfigure the engine for ``config`` (a fresh engine when ``fresh``: after a crash) and warm
        it up when its weights or expert path changed; returns ``reconfigure_s`` and ``warm_up_s``."""
        t = time.perf_counter()
        if fresh and self.backend.kind == "live":
            self.backend = make_backend(self.engine.model_path, config, kind=self.backend.kind)
        elif fresh or config != self.backend.config:  # a repeat keeps its weights and experts; the simulator
            self.backend.reconfigure(config)  # holds no tensors a crash could leave behind: no reload
        reconfigure_s = time.perf_counter() - t
        warm_up_s = 0.0
        engine = getattr(self.backend, "engine", None)  # the weights as loaded, however the config spells them
        loaded = (str(engine.device), engine.dtype, engine.weight_dtype) if isinstance(engine, Engine) \
            else weights_key(config)
        key = (*loaded, is_plain(config), config.experts.hi_precision, config.experts.lo_precision)
        if key != self._warm_key:
            t = time.perf_counter()
            self.warm_up(WARM_UP_REQUESTS)
            warm_up_s = time.perf_counter() - t
            self._warm_key = key
        return {"reconfigure_s": reconfigure_s, "warm_up_s": warm_up_s}

    def warm_up(self, n_requests: int = 2) -> float:
        """Replay the first requests offline, unrecorded, so first-use costs (allocator, kernel
        selection, a new weight layout) are not measured; returns seconds."""
        t = time.perf_counter()
        run_workload(self.backend, warm_up_workload(self.workload, n_requests), mode="offline")
        return time.perf_counter() - t

    def warm_up_hotness(self) -> float:
        """Count expert hotness once, on the config the engine holds now (the study's start), for every
        later trial that places experts by hotness; returns seconds (0 without a torch engine, or when a
        profile is already set)."""
        engine = getattr(self.backend, "engine", None)
        if not isinstance(engine, Engine) or engine.hotness is not None:
            return 0.0
        t = time.perf_counter()
        engine.warm_up_hotness(force=True)
        return time.perf_counter() - t

    # ------------------------------------------------------------------------------ measuring
    def measure(self, fidelity: float = 1.0, *, start_rps: float | None = None, start_scale: float | None = None,
                incumbent_rps: float | None = None, margin: float = 0.0, quality: Mapping[str, float] | None = None,
                stop_on_miss: bool = False, first_step: float | None = None,
                floor_rps: float | None = None, rel_tol: float | None = None) -> Measurement:
        """Measure the engine's current config at ``fidelity``.

        Capacity: the search starts at ``start_rps`` (or the rate scale ``start_scale``; else the study's
        ``rate_scale``); with
        ``incumbent_rps`` it first probes ``incumbent_rps * (1 - margin)`` and stops early when that misses.
        Other objectives: one replay; ``stop_on_miss`` stops it once the SLO cannot be met (pruning).
        ``quality`` (top-1 agreement, mean KL) joins the figures the objectives are read from.
        ``floor_rps`` replaces the lowest rate a capacity search probes (a re-run of a config that met the
        target at no rate starts and ends there); ``rel_tol`` the study's bisection tolerance (a confirmation
        bisects no finer than its noise allows).
        """
        t0 = time.perf_counter()
        n = self.n_requests(fidelity)
        s = self.settings
        m = Measurement(s.objectives, None, fidelity, n)
        if s.capacity:
            self._capacity(m, start_rps, start_scale, incumbent_rps, margin, first_step, floor_rps, rel_tol)
        else:
            replay = self._replay(s.rate_scale, n, stop="missed" if stop_on_miss else None)
            m.replays.append(replay)
            m.best = replay
            if replay.stopped == "missed":
                m.stopped_early, m.reason = True, replay.reason
        if m.best is not None and not m.stopped_early:
            metrics = self.figures(m.best, quality, m.capacity)
            values = [metrics.get(o) for o in s.objectives]
            if all(v is not None and not (isinstance(v, float) and math.isnan(v)) for v in values):
                m.values = [float(v) for v in values]  # type: ignore[arg-type]
            else:
                m.reason = "objective " + ", ".join(o for o, v in zip(s.objectives, values, strict=True) if v is None) \
                    + " was not measured in this run"
        m.wall_s = time.perf_counter() - t0
        return m

    def figures(self, replay: Replay, quality: Mapping[str, float] | None,
                capacity: cap.Capacity | None = None) -> dict[str, Any]:
        """The trial metrics of a replay (``engine.metrics`` names), with quality and capacity."""
        extra: dict[str, Any] = {
            "goodput_rps": replay.slo.goodput_rps, "goodput_tokens_per_s": replay.slo.goodput_tokens_per_s,
            "slo_attainment": replay.slo.attainment,
            **{f"quality_{k}": v for k, v in (quality or {}).items()},
        }
        if capacity is not None:
            base = self.base_rate(replay.prefix_n or replay.n_requests)
            extra["capacity_rps"] = capacity.rate_scale * base if base else None
        return trial_metrics(replay.summary, extra)

    def _capacity(self, m: Measurement, start_rps: float | None, start_scale: float | None,
                  incumbent_rps: float | None, margin: float, first_step: float | None,
                  floor_rps: float | None = None, rel_tol: float | None = None) -> None:
        target = self.slo.attainment_target
        base = self.base_rate(m.n_requests)
        if target is None or base is None:
            raise ValueError("capacity needs per-request latency bounds and a workload with arrival times")

        min_span_s = MIN_PROBE_S * m.fidelity

        def probe(scale: float) -> cap.Probe:
            replay = self._replay(scale, m.n_requests, stop="both", min_span_s=min_span_s)
            m.replays.append(replay)
            return cap.Probe(scale, replay.slo.attainment, replay.met, replay.stopped is not None)

        s = self.settings
        top = max(1.0, (MAX_PROBE_REQUESTS - 1) / min_span_s / base)
        start = (start_rps / base) if start_rps else (start_scale or s.rate_scale)
        incumbent = (incumbent_rps / base) if incumbent_rps else None
        floor = floor_rps / base if floor_rps else min(start, incumbent or start) * s.floor_ratio
        found = cap.find_capacity(
            probe, target, max(start, floor), incumbent=incumbent, margin=margin, rel_tol=rel_tol or s.rel_tol,
            max_probes=s.max_probes, first_step=first_step, min_rate_scale=floor, max_rate_scale=top,
            rate_label=lambda scale: f"{scale * base:.3g} req/s")
        m.capacity = found
        m.stopped_early, m.reason = found.stopped_early, found.reason
        if not found.bounded and found.lo is not None and found.lo >= top:
            m.reason = (f"met the target at {top * base:.4g} req/s, the highest rate a probe replays "
                        f"({MAX_PROBE_REQUESTS} requests over {min_span_s:.3g} s): the capacity is beyond what "
                        "the search can show (a tighter SLO would)")
        met = [r for r in m.replays if r.met]
        m.best = max(met, key=lambda r: r.rate_scale) if met else min(m.replays, key=lambda r: r.rate_scale)

    def _replayed(self, rate_scale: float, n: int, min_span_s: float = 0.0) -> tuple[Any, int]:
        """The workload a replay of the first ``n`` requests at ``rate_scale`` runs, and how many of its
        requests: those ``n``, cycled (``workloads.transform.cycle``) until their arrivals span ``min_span_s``
        at that rate (at most :data:`MAX_PROBE_REQUESTS` requests)."""
        base = self.base_rate(n) if self.settings.mode == "realtime" else None
        if not base or min_span_s <= 0:
            return self.workload, n
        total = max(n, min(MAX_PROBE_REQUESTS, math.ceil(min_span_s * rate_scale * base) + 1))  # never fewer than n
        if total == n:
            return self.workload, n
        if self._cycled.get("key") != (n, total):
            prefix = self.workload.with_requests(list(self.workload.requests)[:n])
            self._cycled = {"key": (n, total), "workload": cycle(prefix, total)}
        return self._cycled["workload"], total

    def _replay(self, rate_scale: float, n: int, stop: str | None = None, min_span_s: float = 0.0) -> Replay:
        """One replay of the first ``n`` requests at ``rate_scale`` (cycled to span ``min_span_s``:
        :meth:`_replayed`); ``stop``: None, ``"missed"`` (stop once the target is out of reach) or ``"both"``
        (also once it is certainly reached)."""
        s = self.settings
        workload, total = self._replayed(rate_scale, n, min_span_s)
        watch: Callable[[Any], bool] | None = None
        sw = None
        if stop is not None and s.mode == "realtime":
            requests = list(workload.requests)[:total]
            sw = SloWatch({r.request_id: r.max_new_tokens for r in requests}, self.slo, stop_when_met=stop == "both")
            if sw.enabled:
                watch = sw
        # A replay the watch stops returns what it measured; the runner aborts the rest, so the
        # backend is idle for the next replay.
        result = run_workload(self.backend, workload, mode=s.mode, rate_scale=rate_scale, max_requests=total,
                              on_progress=watch)
        summary = result.summary()
        slo_result = evaluate(result.requests, summary, result.duration_s, self.slo, s.constraints)
        target_share = self.slo.attainment_target
        met = slo_result.attainment >= target_share if target_share is not None else True
        base = self.base_rate(n) if s.mode == "realtime" else None
        decision = sw.decision if sw is not None else None
        return Replay(rate_scale, rate_scale * base if base else None, total, result, slo_result, summary, met,
                      decision, sw.reason if sw is not None else "", prefix_n=n)


def warm_up_workload(workload: Any, n_requests: int, new_tokens: int = WARM_UP_NEW_TOKENS) -> Any:
    """The first ``n_requests`` of ``workload`` with at most ``new_tokens`` new tokens each (prompts and
    their router trace kept, cut to the tokens that run)."""
    requests = [dataclasses.replace(r, max_new_tokens=min(r.max_new_tokens, new_tokens))
                for r in list(workload.requests)[:n_requests]]
    short = workload.with_requests(requests, name=f"{workload.name}-warm-up")
    if short.router_trace is None:
        return short
    cut = {r.request_id: r.prompt_len + r.max_new_tokens for r in requests}
    return short.with_router_trace(short.router_trace.subset([r.request_id for r in requests], cut))


#: Config areas whose knobs never change a teacher-forced forward pass: configs differing only there
#: share one quality measurement (and one reference).
QUALITY_NEUTRAL_AREAS = ("scheduler", "sampling")
#: Synthetic prompts of 64 tokens the quality check reads: 256 positions resolve top-1 agreement to
#: about 0.4 % a position, enough for a floor such as 0.9, at half ``engine.quality``'s default cost.
QUALITY_PROMPTS = 4


def quality_key(config: EngineConfig) -> str:
    """A hash of the knobs that can change a config's logits."""
    from db.store import stable_hash

    return stable_hash({k: v for k, v in config.to_dict().items() if k not in QUALITY_NEUTRAL_AREAS})


class QualityCheck:
    """Output quality of the engine's current config against its full-precision reference: next-token
    top-1 agreement and mean KL over ``engine.quality``'s synthetic prompts, teacher-forced.

    The reference's logits depend only on the reference config (``engine.quality.reference_config``:
    fp32, every expert as loaded, the model's routing), so they are computed once per reference and
    kept; each trial then costs one pass over the prompts in its own config, with no reconfiguring.
    """

    def __init__(self) -> None:
        self._reference: dict[tuple[str, str], list[Any]] = {}

    def __call__(self, engine: Engine) -> dict[str, float]:
        from engine.quality import compare_logits, prompt_logits, reference_config, synthetic_prompts

        candidate = engine.config
        prompts = synthetic_prompts(engine.spec.vocab_size, n=QUALITY_PROMPTS, seed=candidate.runtime.seed)
        reference = reference_config(candidate)
        key = (quality_key(reference), engine.fingerprint)
        if key not in self._reference:
            engine.reconfigure(reference)
            self._reference[key] = [prompt_logits(engine, p) for p in prompts]
            engine.reconfigure(candidate)
        if engine.hotness is None:
            engine.warm_up_hotness()  # static and dynamic residency plan from a hotness profile
        got = compare_logits(self._reference[key], [prompt_logits(engine, p) for p in prompts])
        return {"top1_agreement": float(got["top1_agreement"]), "mean_kl": float(got["mean_kl"])}


def describe_replays(replays: Sequence[Replay]) -> str:
    """``2.1 req/s 100% met, 4.2 req/s 61% missed`` for logs."""
    return ", ".join(f"{_num(r.rate_rps)} req/s {r.slo.attainment:.0%} {'met' if r.met else 'missed'}"
                     for r in replays)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"
