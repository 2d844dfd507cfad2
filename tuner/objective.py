"""The Optuna objective: sample, build a validated config, reconfigure, run, return numbers.

The model is loaded once per worker (:class:`Objective` holds the engine) and reconfigured between
trials; the seconds each reconfiguration took are stored with the trial. Outcomes:

- complete: the run finished; its requests, steps, experts and telemetry are stored;
- infeasible: the engine rejects the config or it cannot fit in memory; decided in milliseconds,
  before any model work (Optuna: pruned, with every constraint violated);
- pruned: single-objective studies stop a run once attainment can no longer reach the target;
- failed: the run crashed or ran out of memory (the error text is stored; the study goes on).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import optuna
import psutil
import torch

from db.store import stable_hash
from engine.config import ConfigError, EngineConfig
from engine.runner import run_workload
from engine.runtime import Engine, pick_dtype, weights_key
from tuner.feasibility import estimate_memory, memory_problem
from tuner.metrics import objective_values, trial_metrics
from tuner.record import Recorder
from tuner.slo import SloSpec, evaluate, find_capacity
from tuner.space import SearchSpace
from tuner.watch import CutShort, SloWatch, WatchedEngine

log = logging.getLogger(__name__)

# Keys of Optuna user attributes the tuner sets on trials.
ATTR_BASELINE = "baseline"
ATTR_STATE = "moetune_state"
ATTR_CONSTRAINTS = "constraints"
ATTR_METRICS = "metrics"
ATTR_ERROR = "error"
ATTR_INTERRUPTED = "interrupted"
ATTR_RETRY_OF = "retry_of"


class TrialFailed(Exception):  # noqa: N818 - Optuna's `catch` names what happened, like TrialPruned
    """A trial that crashed; recorded, and the study goes on (passed to ``study.optimize(catch=)``)."""


@dataclass
class Objective:
    """Callable objective for ``study.optimize``; one per worker process."""

    engine: Engine
    model: str
    workload: Any  # workloads.schema.Workload
    space: SearchSpace
    base: EngineConfig
    slo: SloSpec
    objectives: list[str]
    recorder: Recorder
    mode: str = "realtime"
    rate_scale: float = 1.0
    capacity: bool = False
    max_requests: int | None = None
    load_s: float = 0.0
    memory_limit_bytes: int | None = None
    """Memory a config may use beyond what the process holds; None: what the machine has free."""
    prune: bool = True
    quality: bool = True
    """Measure output quality against the full-precision reference after each run (when the engine can)."""
    reconfigure_s: list[float] = field(default_factory=list)
    _engine_suspect: bool = False

    # ---------------------------------------------------------------------------- the objective
    def __call__(self, trial: optuna.Trial) -> float | Sequence[float]:
        baseline = trial.user_attrs.get(ATTR_BASELINE)
        values = self.space.sample(trial)
        source = f"trial {trial.number}"
        try:
            config = self.space.to_config(values, self.base, source=source)
        except ConfigError as e:
            raw = self.base.to_dict()  # the config as asked for, unvalidated
            for key, value in {**self.space.fixed, **values}.items():
                area, name = key.split(".", 1)
                raw.setdefault(area, {})[name] = value
            trial_id = self.recorder.start(trial.number, raw, stable_hash(raw), baseline)
            self._stop(trial, trial_id, "infeasible", str(e))
        trial_id = self.recorder.start(trial.number, config.to_dict(), config.config_hash(), baseline)
        trial.set_user_attr("config_hash", config.config_hash())
        problem = self._memory_problem(config)
        if problem:
            self._stop(trial, trial_id, "infeasible", f"{source}: {problem}")
        try:
            return self._run(trial, trial_id, config, baseline)
        except CutShort as e:
            self._stop(trial, trial_id, "pruned", str(e))
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
        """Run the first few requests once, unrecorded, so the first trial (the defaults baseline)
        does not pay for first-use costs (allocator, kernel selection); returns seconds."""
        t = time.perf_counter()
        run_workload(self.engine, self.workload, mode="offline", max_requests=n_requests)
        return time.perf_counter() - t

    # ------------------------------------------------------------------------------- the parts
    def _run(self, trial: optuna.Trial, trial_id: int, config: EngineConfig,
             baseline: str | None) -> float | Sequence[float]:
        reconfigure_s = self._reconfigure(config)
        requests = list(self.workload.requests)[: self.max_requests or None]
        arrivals = {r.request_id: 0.0 if self.mode == "offline" else r.arrival_s / self.rate_scale
                    for r in requests}
        watched = WatchedEngine(self.engine, arrivals)
        watch = SloWatch(watched, self.slo)
        # Baselines always run to the end: the gain over them needs their numbers.
        prune = self.prune and baseline is None and len(self.objectives) == 1 and watch.enabled
        on_step = watch if prune else None
        result = run_workload(watched, self.workload, mode=self.mode, rate_scale=self.rate_scale,  # type: ignore[arg-type]
                              max_requests=self.max_requests, on_step=on_step)
        quality_s = None
        if self.quality:
            t = time.perf_counter()
            measured = measure_quality(self.engine)
            quality_s = time.perf_counter() - t
            if measured is not None:
                result.quality = {k: float(measured[k]) for k in ("top1_agreement", "mean_kl") if k in measured}
        summary = result.summary()
        slo_result = evaluate(result.requests, summary, result.duration_s, self.slo)
        extra: dict[str, Any] = {
            "goodput_rps": slo_result.goodput_rps,
            "goodput_tokens_per_s": slo_result.goodput_tokens_per_s,
            "slo_attainment": slo_result.attainment,
            "reconfigure_s": reconfigure_s,
            "quality_s": quality_s,
        }
        if self.capacity:
            extra.update(self._capacity(slo_result.attainment))
        metrics = trial_metrics(summary, extra)
        objective = objective_values(metrics, self.objectives)
        summary.update(extra)
        summary.update(
            objectives=dict(zip(self.objectives, objective, strict=True)) if isinstance(objective, list) else None,
            constraints=slo_result.constraints,
            feasible=slo_result.feasible,
            slo_unmeasured=slo_result.unmeasured,
        )
        result_dict = result.to_dict()
        result_dict["summary"] = summary
        result_dict["meta"]["tuner"] = {
            "trial": trial.number,
            "baseline": baseline,
            "params": dict(trial.params),
            "reconfigure_s": reconfigure_s,
            "engine_load_s": self.load_s,
            "weights_load_s": self.engine.load_s,
        }
        self.recorder.finish(trial_id, result_dict, slo_attainment=slo_result.attainment,
                             goodput_rps=slo_result.goodput_rps, met=slo_result.met)
        set_constraints(trial, slo_result.constraints)
        trial.set_user_attr(ATTR_METRICS, {k: v for k, v in metrics.items() if v is not None})
        if isinstance(objective, str):
            trial.set_user_attr(ATTR_STATE, "failed")
            trial.set_user_attr(ATTR_ERROR, objective)
            raise TrialFailed(objective)
        trial.set_user_attr(ATTR_STATE, "complete")
        log.info("trial %d: %s; reconfigure %.3fs", trial.number,
                 ", ".join(f"{k}={v:.4g}" for k, v in zip(self.objectives, objective, strict=True)),
                 reconfigure_s)
        return objective[0] if len(objective) == 1 else objective

    def _reconfigure(self, config: EngineConfig) -> float:
        if self._engine_suspect:
            # After a crash mid-run the engine's state is unknown: load it afresh.
            t = time.perf_counter()
            self.engine = Engine(self.engine.model_path, config)
            self._engine_suspect = False
            seconds = time.perf_counter() - t
        else:
            seconds = self.engine.reconfigure(config)
        self.reconfigure_s.append(seconds)
        return seconds

    def _capacity(self, attainment_now: float) -> dict[str, Any]:
        target = self.slo.attainment_target
        if target is None:
            return {}

        def attainment_at(scale: float) -> float:
            if scale == self.rate_scale:
                return attainment_now
            r = run_workload(self.engine, self.workload, mode="realtime", rate_scale=scale,
                             max_requests=self.max_requests)
            return evaluate(r.requests, r.summary(), r.duration_s, self.slo).attainment

        cap = find_capacity(attainment_at, target, self.rate_scale)
        arrivals = [r.arrival_s for r in list(self.workload.requests)[: self.max_requests or None]]
        span_s = max(arrivals) - min(arrivals) if arrivals else 0.0
        base_rate = (len(arrivals) - 1) / span_s if span_s > 0 else 0.0  # requests/s at rate scale 1
        return {"capacity_rate_scale": cap.rate_scale, "capacity_rps": cap.rate_scale * base_rate,
                "capacity_bounded": cap.bounded, "capacity_probes": [list(p) for p in cap.probes]}

    def _memory_problem(self, config: EngineConfig) -> str | None:
        e = self.engine
        rt = config.runtime
        same_weights = weights_key(config) == weights_key(e.config)
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

    def _stop(self, trial: optuna.Trial, trial_id: int, state: str, why: str) -> NoReturn:
        """Record an infeasible or pruned trial and tell Optuna (pruned, every constraint violated)."""
        self.recorder.fail(trial_id, why, state)
        trial.set_user_attr(ATTR_STATE, state)
        trial.set_user_attr(ATTR_ERROR, why)
        set_constraints(trial, {n: 1.0 for n in self.slo.constraint_names()})
        log.info("trial %d %s: %s", trial.number, state, why)
        raise optuna.TrialPruned(why)


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


def quality_available() -> bool:
    """Whether this engine can measure output quality (``engine.quality``)."""
    try:
        from engine.quality import evaluate  # noqa: F401
    except ImportError:
        return False
    return True


def measure_quality(engine: Engine) -> dict[str, Any] | None:
    """Top-1 agreement and mean KL of the engine's current config against its full-precision
    reference (``engine.quality.evaluate``), or None when the engine cannot measure it."""
    try:
        from engine.quality import evaluate as quality_of
    except ImportError:
        return None
    return dict(quality_of(engine))


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
