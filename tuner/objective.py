"""The Optuna objective: sample, build a validated config, reconfigure, measure, return numbers.

The model is loaded once per worker and reconfigured between trials (:class:`tuner.measure.Measurer`).
A trial's config is first checked for its quality floor (cached by the knobs that change the maths),
then measured fidelity by fidelity (a prefix of the workload, then all of it):

- the capacity search is warm-started from the best capacity of the study at that fidelity; at the
  first fidelity it stops after one probe when the config cannot beat it beyond the study's noise;
- after each prefix the intermediate value goes to Optuna's pruner (successive halving): a trial that
  is not competitive stops there;
- baselines are measured at every fidelity and never stopped (their numbers are the reference).

Outcomes:

- complete: measured on the whole workload; its best replay's requests, steps, experts and
  telemetry are stored, every probe of every fidelity too;
- infeasible: the engine rejects the config, it cannot fit in memory, or its output quality is below
  the floor; decided before any replay (Optuna: pruned, with every constraint violated);
- pruned: stopped early (cannot beat the best so far, or the pruner cut it at a prefix; goodput
  studies: the SLO could no longer be met);
- failed: the run crashed or ran out of memory (the error text is stored; the study goes on).

Every trial records its time: reconfigure, warm-up, replays, quality check and the overhead between.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import optuna
import psutil
import torch

from db.store import stable_hash
from engine.config import ConfigError, EngineConfig, merge_flat
from engine.runtime import Engine, pick_dtype
from tuner import capacity as cap
from tuner.capacity import REL_TOL
from tuner.feasibility import estimate_memory, memory_problem
from tuner.measure import Measurement, Measurer, QualityCheck, quality_key
from tuner.record import Recorder
from tuner.slo import SLO_METRICS, SloSpec, evaluate
from tuner.space import SearchSpace

log = logging.getLogger(__name__)

# Keys of Optuna user attributes the tuner sets on trials.
ATTR_BASELINE = "baseline"
ATTR_STATE = "moetune_state"
ATTR_CONSTRAINTS = "constraints"
ATTR_METRICS = "metrics"
ATTR_ERROR = "error"
ATTR_INTERRUPTED = "interrupted"
ATTR_RETRY_OF = "retry_of"
ATTR_RUNGS = "rung_values"
"""``{rung index: value}`` of the fidelities a trial was measured at (stopped searches not included)."""


class TrialFailed(Exception):  # noqa: N818 - Optuna's `catch` names what happened, like TrialPruned
    """A trial that crashed; recorded, and the study goes on (passed to ``study.optimize(catch=)``)."""


@dataclass
class Objective:
    """Callable objective for ``study.optimize``; one per worker process."""

    measurer: Measurer
    model: str
    space: SearchSpace
    base: EngineConfig
    slo: SloSpec
    objectives: list[str]
    recorder: Recorder
    constraints: list[str]
    """The SLO bounds every trial is checked against (``tuner.slo.study_constraints``)."""
    rungs: tuple[float, ...] = (1.0,)
    """Fidelities (shares of the workload) a trial is measured at, ending with 1."""
    load_s: float = 0.0
    memory_limit_bytes: int | None = None
    """Memory a config may use beyond what the process holds; None: what the machine has free."""
    prune: bool = True
    quality: bool = True
    """Measure output quality against the full-precision reference (False: no check runs, and every
    trial records ``quality_check: "off"``; a searched trial stopped early on the first rung before its
    check records ``"pruned first"``)."""
    margin: Callable[[], float] = lambda: REL_TOL
    """The early-stop margin: the study's measured noise (relative spread of the objective) once known."""
    reconfigure_s: list[float] = field(default_factory=list)
    _engine_suspect: bool = False
    _quality_cache: dict[str, dict[str, float] | None] = field(default_factory=dict)
    _check: QualityCheck = field(default_factory=QualityCheck)

    @property
    def engine(self) -> Engine:
        return self.measurer.engine

    @property
    def single(self) -> bool:
        return len(self.objectives) == 1

    @property
    def direction(self) -> str:
        from tuner.metrics import OBJECTIVES

        return OBJECTIVES[self.objectives[0]]

    # ---------------------------------------------------------------------------- the objective
    def __call__(self, trial: optuna.Trial) -> float | Sequence[float]:
        baseline = trial.user_attrs.get(ATTR_BASELINE)
        values = self.space.sample(trial)
        source = f"trial {trial.number}"
        try:
            config = self.space.to_config(values, self.base, source=source)
        except ConfigError as e:
            raw = merge_flat(self.base.to_dict(), {**self.space.fixed, **values}, source)  # as asked, unvalidated
            trial_id = self.recorder.start(trial.number, raw, stable_hash(raw), baseline)
            self._stop(trial, trial_id, "infeasible", str(e))
        trial_id = self.recorder.start(trial.number, config.to_dict(), config.config_hash(), baseline)
        trial.set_user_attr("config_hash", config.config_hash())
        problem = self._memory_problem(config)
        if problem:
            self._stop(trial, trial_id, "infeasible", f"{source}: {problem}")
        try:
            return self._run(trial, trial_id, config, baseline)
        except optuna.TrialPruned:
            raise
        except KeyboardInterrupt:
            self.recorder.fail(trial_id, "interrupted before the run finished", "failed")
            trial.set_user_attr(ATTR_INTERRUPTED, True)
            self._engine_suspect = True
            retry_attrs = {k: v for k, v in trial.user_attrs.items() if k in (ATTR_BASELINE,)}
            trial.study.enqueue_trial(trial.params, user_attrs={**retry_attrs, ATTR_RETRY_OF: trial.number})
            raise
        except ConfigError as e:  # the engine refused the config only when applying it
            self._stop(trial, trial_id, "infeasible", str(e))
        except Exception as e:  # noqa: BLE001 - any crash is recorded and the study goes on
            self._engine_suspect = True
            msg = _one_line(e)
            if isinstance(e, MemoryError) or "out of memory" in msg.lower():
                msg = f"out of memory: {msg}"
            self.recorder.fail(trial_id, msg, "failed")
            trial.set_user_attr(ATTR_STATE, "failed")
            trial.set_user_attr(ATTR_ERROR, msg)
            _free_memory()
            raise TrialFailed(msg) from e

    def warm_up(self, n_requests: int = 2) -> float:
        """Replay the first few requests once, unrecorded, so the first trial (the defaults baseline)
        does not pay for first-use costs (allocator, kernel selection); returns seconds."""
        return self.measurer.warm_up(n_requests)

    # ------------------------------------------------------------------------------- the parts
    def _run(self, trial: optuna.Trial, trial_id: int, config: EngineConfig,
             baseline: str | None) -> float | Sequence[float]:
        t_trial = time.perf_counter()
        timing = self.measurer.apply(config, fresh=self._engine_suspect)
        self._engine_suspect = False
        self.reconfigure_s.append(timing["reconfigure_s"])
        rungs = self.effective_rungs() if self.single else (1.0,)
        # A searched trial checks its quality only once its first-rung search was not stopped early at the
        # incumbent's bar (most trials of a long search are stopped there, and their quality is read by
        # nothing); a trial whose objectives read quality, and every baseline, checks it first.
        defer = (baseline is None and self.prune and len(rungs) > 1 and self.quality
                 and not any(o.startswith("quality_") for o in self.objectives))
        quality: dict[str, float] | None = None
        timing.update(quality_s=0.0, quality_cached=False, quality_deferred=defer)

        def check_quality() -> None:
            nonlocal quality
            t = time.perf_counter()
            quality, timing["quality_cached"] = self._quality(config)
            timing["quality_s"] = time.perf_counter() - t
            timing["quality_deferred"] = False
            low = self._quality_problem(quality)
            if low:
                self._stop(trial, trial_id, "infeasible", f"trial {trial.number}: {low}; not measured further",
                           summary=self._timing(timing, done, t_trial, quality))

        done: list[Measurement] = []
        if not defer:
            check_quality()
        rung_values: dict[str, float] = {}
        margin = self.margin()
        for i, fidelity in enumerate(rungs):
            last = i == len(rungs) - 1
            searched = baseline is None and self.prune and self.single
            # The early stop at the incumbent less the noise is for the first fidelity alone: a trial the
            # pruner promoted is competitive, and its bar would be a probe at a low rate (a long replay).
            incumbent = incumbent_value(trial.study, i, self.direction) if searched and i == 0 else None
            start = incumbent_value(trial.study, i, self.direction) or None
            start_scale = None
            if start is None and done and done[-1].capacity is not None and done[-1].capacity.rate_scale > 0:
                start_scale = done[-1].capacity.rate_scale
            # A searched trial bisects no finer than half the study's noise (configs closer than that are
            # told apart by the confirmation), and one the pruner promoted starts a warm step from the
            # incumbent of its rung: competitive, so its knee lies near.
            rel_tol = cap.noise_tolerance(margin, self.measurer.settings.rel_tol) if searched else None
            first_step = cap.WARM_STEP if searched and i > 0 and start is not None else None
            m = self.measurer.measure(
                fidelity, start_rps=start, start_scale=start_scale, incumbent_rps=incumbent,
                margin=margin, quality=quality, stop_on_miss=searched and not self.measurer.settings.capacity,
                first_step=first_step, rel_tol=rel_tol)
            done.append(m)
            self.recorder.measurement(trial_id, "search", m)
            summary = self._timing(timing, done, t_trial, quality)
            if m.stopped_early:
                self._stop(trial, trial_id, "pruned", f"{_fidelity(fidelity)}: {m.reason}", summary=summary)
            if m.values is None:
                raise TrialFailed(m.reason or "the objective was not measured")
            if i == 0 and defer:
                # Before its value counts anywhere: a config under the quality floor must not become the
                # incumbent at this rung (its bar would cut good configs) nor a competitor of the pruner.
                check_quality()
            rung_values[str(i)] = m.values[0]
            trial.set_user_attr(ATTR_RUNGS, rung_values)
            if self.single and len(rungs) > 1:
                trial.report(m.values[0], step=i + 1)  # successive halving's first rung is step 1
                # Asking the pruner records the value as a competitor at this rung: a baseline asks too (and
                # goes on whatever it says), so the first searched trials are measured against the baselines
                # instead of being promoted for want of competitors.
                if not last and trial.should_prune() and searched:
                    self._stop(trial, trial_id, "pruned",
                               f"{_fidelity(fidelity)}: {self.objectives[0]} {m.values[0]:.4g} is not among the best "
                               "at this fidelity (successive halving); not measured on the whole workload",
                               summary=summary)
        return self._finish(trial, trial_id, baseline, done, timing, t_trial, quality)

    def effective_rungs(self) -> tuple[float, ...]:
        """The fidelity rungs that replay different numbers of requests (a prefix as long as the whole
        workload is the whole workload)."""
        by_n: dict[int, float] = {}
        for f in self.rungs:
            by_n[self.measurer.n_requests(f)] = f  # the last fidelity with that many requests
        return tuple(sorted(by_n.values()))

    def _finish(self, trial: optuna.Trial, trial_id: int, baseline: str | None, done: list[Measurement],
                timing: dict[str, Any], t_trial: float, quality: Mapping[str, float] | None
                ) -> float | Sequence[float]:
        final = done[-1]
        best = final.best
        assert best is not None and final.values is not None
        figures = self.measurer.figures(best, quality, final.capacity)
        checked = evaluate(best.result.requests, {**best.summary, **figures}, best.result.duration_s, self.slo,
                           self.constraints)
        summary: dict[str, Any] = {**best.summary, **{k: v for k, v in figures.items() if v is not None}}
        objective = dict(zip(self.objectives, final.values, strict=True))
        summary.update(self._timing(timing, done, t_trial, quality))
        summary.update(objectives=objective, constraints=checked.constraints, feasible=checked.feasible,
                       slo_unmeasured=checked.unmeasured, best_replay={
                           "rate_scale": best.rate_scale, "rate_rps": best.rate_rps, "stopped": best.stopped})
        if final.capacity is not None:
            c = final.capacity
            base = self.measurer.base_rate(final.n_requests) or 0.0
            summary.update(capacity_bounded=c.bounded, capacity_lo_rps=(c.lo or 0.0) * base,
                           capacity_hi_rps=c.hi * base if c.hi is not None else None, capacity_probes=len(c.probes))
        result_dict = best.result.to_dict()
        result_dict["summary"] = summary
        result_dict["meta"]["tuner"] = {
            "trial": trial.number, "baseline": baseline, "params": dict(trial.params),
            "reconfigure_s": timing["reconfigure_s"], "engine_load_s": self.load_s,
            "weights_load_s": self.engine.load_s if self.measurer.backend.kind == "live" else 0.0,
        }
        self.recorder.finish(trial_id, result_dict, met=best.slo.met)
        set_constraints(trial, checked.constraints)
        trial.set_user_attr(ATTR_METRICS, {k: v for k, v in figures.items() if v is not None})
        trial.set_user_attr(ATTR_STATE, "complete")
        log.info("trial %d: %s; %.1f s of replays, %.2f s overhead", trial.number,
                 ", ".join(f"{k}={v:.4g}" for k, v in objective.items()), summary["measured_s"], summary["overhead_s"])
        return final.values[0] if self.single else final.values

    def _timing(self, timing: Mapping[str, Any], done: list[Measurement], t_trial: float,
                quality: Mapping[str, float] | None) -> dict[str, Any]:
        """The trial's time budget: replays (measured), quality check, and the overhead around them."""
        wall = time.perf_counter() - t_trial
        measured = sum(m.runs_s for m in done)
        quality_s = 0.0 if timing.get("quality_cached") else float(timing.get("quality_s") or 0.0)
        out: dict[str, Any] = {
            "reconfigure_s": timing["reconfigure_s"], "warm_up_s": timing["warm_up_s"], "quality_s": quality_s,
            "quality_cached": bool(timing.get("quality_cached")), "measured_s": measured,
            "overhead_s": max(0.0, wall - measured - quality_s), "wall_s": wall,
            "fidelity": done[-1].fidelity if done else 0.0,
            "fidelities": [{"fidelity": m.fidelity, "n_requests": m.n_requests, "value": m.value,
                            "upper_bound": m.upper_bound, "stopped_early": m.stopped_early, "runs_s": m.runs_s,
                            "probes": len(m.replays)} for m in done],
        }
        if quality:
            out.update({f"quality_{k}": v for k, v in quality.items()})
        # Which path produced the quality figures: measured, or no check at all (--no-quality).
        out["quality_check"] = ("cached" if timing.get("quality_cached") else "measured") if quality else \
            "pruned first" if timing.get("quality_deferred") else "off"
        return out

    def _quality(self, config: EngineConfig) -> tuple[dict[str, float] | None, bool]:
        """Top-1 agreement and mean KL of ``config`` against the full-precision reference, measured
        once per setting of the knobs that change the maths; returns (quality, from the cache)."""
        if not self.quality:
            return None, False
        key = quality_key(config)
        if key in self._quality_cache:
            return self._quality_cache[key], True
        got = self._check(self.engine)
        self._quality_cache[key] = got
        return got, False

    def _quality_problem(self, quality: Mapping[str, float] | None) -> str | None:
        """Why ``quality`` misses a quality bound of the SLO, or None."""
        if not quality:
            return None
        figures = {f"quality_{k}": v for k, v in quality.items()}
        for name in self.constraints:
            m = SLO_METRICS[name]
            if not m.summary_key.startswith("quality_") or figures.get(m.summary_key) is None:
                continue
            value, limit = figures[m.summary_key], self.slo.bounds[name]
            if (m.bound == "min" and value < limit) or (m.bound == "max" and value > limit):
                return f"quality {m.summary_key} {value:.4g} misses {name}={limit:g}"
        return None

    def _memory_problem(self, config: EngineConfig) -> str | None:
        if self.measurer.backend.kind != "live":  # the simulator prices memory itself: a config that does not
            return None  # fit its profile is refused at reconfigure (ConfigError: infeasible)
        e = self.engine
        rt = config.runtime
        same_weights = e.loads_same_weights(config)
        if same_weights:
            dtype, weight_dtype = e.dtype, e.weight_dtype
        else:
            try:
                from engine.runtime import pick_device, pick_weight_dtype

                device = pick_device(rt.device)
                dtype = pick_dtype(rt.compute_dtype, e.ckpt.dtype, device, e.spec.hidden_size,
                                   e.spec.expert_intermediate)
                weight_dtype = pick_weight_dtype(rt.cpu_kernels, dtype, e.ckpt.dtype, device)
            except ConfigError as err:
                return str(err)
        estimate = estimate_memory(e.spec, config, dtype.itemsize, reload_weights=not same_weights,
                                   weight_dtype_bytes=weight_dtype.itemsize)
        if self.memory_limit_bytes is not None:
            available = self.memory_limit_bytes
        elif e.device.type == "cuda":
            available = torch.cuda.mem_get_info(e.device)[0]
        else:
            available = psutil.virtual_memory().available
        return memory_problem(estimate, available)

    def _stop(self, trial: optuna.Trial, trial_id: int, state: str, why: str,
              summary: Mapping[str, Any] | None = None) -> NoReturn:
        """Record an infeasible or pruned trial and tell Optuna (pruned, every constraint violated)."""
        self.recorder.fail(trial_id, why, state, summary=summary)
        trial.set_user_attr(ATTR_STATE, state)
        trial.set_user_attr(ATTR_ERROR, why)
        set_constraints(trial, {n: 1.0 for n in self.constraints})
        log.info("trial %d %s: %s", trial.number, state, why)
        raise optuna.TrialPruned(why)


def incumbent_value(study: optuna.Study, rung: int, direction: str = "maximize") -> float | None:
    """The best value any trial of ``study`` reached at fidelity rung ``rung`` (None: none yet).

    Read from the trials' own records (``ATTR_RUNGS``), so workers sharing a study share incumbents;
    searches stopped early never record a value and never become the incumbent.
    """
    best: float | None = None
    for t in study.get_trials(deepcopy=False):
        v = (t.user_attrs.get(ATTR_RUNGS) or {}).get(str(rung))
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        if best is None or (v > best if direction == "maximize" else v < best):
            best = float(v)
    return best


def _fidelity(fidelity: float) -> str:
    return "whole workload" if fidelity >= 1 else f"{fidelity:.0%} of the workload"


#: Optuna >= 5 takes constraints from the trial (``set_constraint``); older ones from a sampler's
#: ``constraints_func`` (:func:`constraints_of`).
NATIVE_CONSTRAINTS = hasattr(optuna.trial.Trial, "set_constraint")


def set_constraints(trial: optuna.Trial, constraints: Mapping[str, float]) -> None:
    """Store a trial's constraint values (<= 0 met) for the sampler and for us."""
    trial.set_user_attr(ATTR_CONSTRAINTS, dict(constraints))
    if NATIVE_CONSTRAINTS:
        for name, value in constraints.items():
            trial.set_constraint(name, value)


def constraints_of(names: Sequence[str]):
    """Optuna < 5 ``constraints_func``: the values a trial stored (missing ones: violated)."""
    names = list(names)

    def constraints(frozen: optuna.trial.FrozenTrial) -> list[float]:
        stored: Mapping[str, float] = frozen.user_attrs.get(ATTR_CONSTRAINTS) or {}
        return [float(stored.get(n, 1.0)) for n in names]

    return constraints


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
