"""``engine validate-sim``: run N configs live and simulated, report the simulator's error per metric.

Configs are drawn at random (seeded) from the tuner's search space for the profile's machine
(:func:`tuner.space.build_space` over the profile's hardware), so none is one of the two configs
calibration fitted its overheads on (the defaults, and static residency with host experts) except
by chance. Each config runs live on this machine, recording the routing it took; the simulator then
runs the same workload with that routing, so the comparison measures the cost model, not routing.

Per metric (output tokens/s, p99 TPOT, p99 TTFT, p50 TPOT): the signed relative error of every config
and the median absolute error; the ranking of the configs by output tokens/s, live against simulated
(Spearman's rho). Targets (issue 13): median absolute error <= 10 % for tokens/s and p99 TPOT,
<= 15 % for p99 TTFT, Spearman >= 0.9.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

METRICS = ("output_tokens_per_s", "tpot_p99_ms", "ttft_p99_ms", "tpot_p50_ms")
TARGETS = {"output_tokens_per_s": 0.10, "tpot_p99_ms": 0.10, "ttft_p99_ms": 0.15}
SPEARMAN_TARGET = 0.9


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties sharing the mean of their ranks."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        same = x == v
        ranks[same] = ranks[same].mean()
    return ranks


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation of ``a`` and ``b`` (None with fewer than 3 points or no spread)."""
    if len(a) < 3:
        return None
    ra, rb = _ranks(np.asarray(a, np.float64)), _ranks(np.asarray(b, np.float64))
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """The signed relative error of a prediction, ``(predicted - measured) / measured`` (None without both
    figures or with nothing measured)."""
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def median_abs_errors(errors: list[dict[str, float | None]], metrics: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per metric: the median absolute error over the rows that have one, its target (:data:`TARGETS`) and
    whether it is met (None without a target or an error)."""
    out: dict[str, dict[str, Any]] = {}
    for m in metrics:
        errs = [abs(e[m]) for e in errors if e.get(m) is not None]
        med = float(np.median(errs)) if errs else None
        target = TARGETS.get(m)
        out[m] = {"median_abs_error": med, "target": target,
                  "met": None if target is None or med is None else med <= target}
    return out


def draw_configs(profile: Any, n: int, seed: int, base: Any) -> list[tuple[dict[str, Any], Any]]:
    """``n`` configs ``(knob values, EngineConfig)`` drawn at random from the tuner's search space for
    the profile's hardware; draws the engine rejects are skipped (and logged)."""
    import optuna

    from engine.config import ConfigError
    from tuner.space import build_space

    space = build_space(profile.hardware(), base=base)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    out: list[tuple[dict[str, Any], Any]] = []
    tries = 0
    while len(out) < n and tries < 20 * n:
        tries += 1
        trial = study.ask()
        values = space.sample(trial)
        try:
            cfg = space.to_config(values, base)
            cfg.validate()
        except (ConfigError, ValueError) as e:
            log.info("validate-sim: skipped a draw: %s", e)
            continue
        out.append((values, cfg))
    return out


def hybrid_grid(model: str, profile: Any, base: Any) -> list[tuple[dict[str, Any], Any]]:
    """The hybrid knobs one at a time around static residency: resident budget at 25 / 50 / 100 % of
    the model's experts (as loaded) x missing experts on the host, fetched or decided by cost; int8 and
    int4 resident experts; replicas; half the SMs for expert compute (a device profile only)."""
    from engine.backend_sim import resolve_sim_model

    spec = resolve_sim_model(model)[0]
    all_gib = spec.expert_params() * 2 * spec.n_experts * len(spec.moe_layers) / 2**30  # bf16 as stored
    out: list[dict[str, Any]] = []
    for share in (0.25, 0.5, 1.0):
        for missing in ("host", "fetch", "auto"):
            out.append({"experts.residency": "static", "experts.resident_budget_gib": round(all_gib * share, 4),
                        "execution.missing_expert": missing})
    half = {"experts.residency": "static", "experts.resident_budget_gib": round(all_gib * 0.5, 4),
            "execution.missing_expert": "auto"}
    out += [{**half, "experts.hi_precision": "int8"}, {**half, "experts.hi_precision": "int4"},
            {"execution.max_replicas": 1, "execution.replica_threshold": 1.5}]
    if profile.device is not None:
        out.append({**half, "execution.expert_sm_share": 0.5})
    configs = []
    for values in out:
        data = base.to_dict()
        for key, value in values.items():
            area, name = key.split(".", 1)
            data[area][name] = value
        configs.append((values, type(base).from_dict(data, source="hybrid grid")))
    return configs


def _metrics(summary: dict[str, Any]) -> dict[str, float | None]:
    return {m: summary.get(m) for m in METRICS}


def validate(model: str, workload: Any, profile: Any, n_configs: int, *, seed: int = 0, mode: str = "offline",
             max_requests: int | None = None, progress: Callable[[str], None] | None = None,
             grid: str = "random") -> dict[str, Any]:
    """Run ``n_configs`` configs live and simulated (module docstring); rows and the error summary."""
    from engine.backend import make_backend
    from engine.backend_sim import SimBackend
    from engine.config import ConfigError, EngineConfig
    from engine.runner import run_workload
    from workloads.router import RouterTrace

    say = progress or (lambda _m: None)
    base = EngineConfig()
    rows: list[dict[str, Any]] = []
    draws = hybrid_grid(model, profile, base) if grid == "hybrid" else draw_configs(profile, 3 * n_configs, seed, base)
    for i, (values, cfg) in enumerate(draws):
        if len(rows) >= n_configs:
            break
        changed = {k: v for k, v in values.items() if v != _default(base, k)}
        try:  # what the simulator refuses (a top-k beyond the model's, ...) is skipped before the live run
            SimBackend.from_model(model, cfg, profile=profile)
        except ConfigError as e:
            say(f"config {i + 1}: skipped before running: {e}")
            continue
        say(f"config {i + 1}/{n_configs}: {changed or 'defaults'}")
        try:
            live = make_backend(model, cfg)
            got = run_workload(live, workload, mode=mode, max_requests=max_requests, record_routes=True)
            routes = got.meta["routes"]
            keys = list(routes)
            trace = RouterTrace.from_arrays(request_ids=keys, expert_ids=[routes[k][0] for k in keys],
                                            gate_weights=[routes[k][1] for k in keys],
                                            model_identity=live.model_identity())
            sim = SimBackend.from_model(model, cfg, profile=profile, trace=trace)
            priced = run_workload(sim, workload, mode=mode, max_requests=max_requests)
        except ConfigError as e:
            say(f"  skipped: {e}")
            continue
        lv, sv = _metrics(got.summary()), _metrics(priced.summary())
        err = {m: relative_error(sv[m], lv[m]) for m in METRICS}
        say("  live " + ", ".join(f"{m} {lv[m]:.4g}" for m in METRICS if lv[m] is not None) + " | sim "
            + ", ".join(f"{m} {sv[m]:.4g}" for m in METRICS if sv[m] is not None) + " | error "
            + ", ".join(f"{m} {100 * err[m]:+.0f}%" for m in METRICS if err[m] is not None))
        rows.append({"config": changed, "config_hash": cfg.config_hash(), "live": lv, "sim": sv, "error": err,
                     "same_steps": len(got.steps) == len(priced.steps)})
    summary: dict[str, Any] = median_abs_errors([r["error"] for r in rows], METRICS)
    rho = spearman([r["live"]["output_tokens_per_s"] for r in rows], [r["sim"]["output_tokens_per_s"] for r in rows])
    summary["spearman_output_tokens_per_s"] = {"rho": rho, "target": SPEARMAN_TARGET,
                                               "met": None if rho is None else rho >= SPEARMAN_TARGET}
    return {"model": model, "workload": workload.name, "mode": mode, "profile": profile.describe(),
            "configs": len(rows), "rows": rows, "summary": summary}


def _default(base: Any, key: str) -> Any:
    section, _, name = key.partition(".")
    return getattr(getattr(base, section), name)
