"""``engine plan``: the hybrid knobs of one model priced on machines that are not here.

For each profile, a grid around static residency: the expert budget at half and all of what the
device has left after dense weights, the KV cache and activations (and every expert resident where
they fit), resident experts in the stored precision, int8 or int4, missing experts on the host,
fetched or decided by cost; then micro-batches and replicas on the row with the most budget.
Each config runs simulated: offline throughput, p99 TTFT and TPOT at the workload's own rate, and
the capacity at an SLO (default: the tuner's; the highest arrival-rate scale keeping attainment >= the target,
:func:`tuner.capacity.find_capacity`, DistServe's goodput@90, down to :data:`MIN_RATE_SCALE` of the
workload's rate). Pure simulation: no weights, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

GIB = 2**30
#: The lowest arrival-rate scale the capacity column probes: a simulated probe costs no waiting, so the
#: search goes lower than a live one (``tuner.capacity.MIN_RATE_SCALE``) before it reports 0.
MIN_RATE_SCALE = 1 / 64


def _free_gib(model: str, profile: Any, base: Any) -> float:
    """Device memory (GiB) left for expert copies under ``base`` with no expert resident."""
    from engine.backend_sim import SimBackend
    from engine.config import ConfigError

    sim = SimBackend.from_model(model, base.replace(residency="static", resident_budget_gib=0.0,
                                                    missing_expert="host"), profile=profile)
    lo, hi = 0.0, profile.fast.mem_bytes / GIB
    for _ in range(20):  # the largest budget the simulator's memory check accepts, as a trial meets it
        mid = (lo + hi) / 2
        try:
            sim.reconfigure(base.replace(residency="static", resident_budget_gib=mid, missing_expert="host"))
            lo = mid
        except ConfigError:
            hi = mid
    return lo


def plan_configs(model: str, profile: Any, base: Any) -> list[dict[str, Any]]:
    """The grid of the module docstring, as knob overrides of ``base``."""
    free = math.floor(_free_gib(model, profile, base) * 0.98 * 10) / 10  # a margin below the limit, in 0.1 GiB
    rows: list[dict[str, Any]] = []
    from engine.backend_sim import SimBackend
    from engine.config import ConfigError

    try:
        SimBackend.from_model(model, base, profile=profile)
        rows.append({})  # every expert resident fits
    except ConfigError:
        pass
    for share in (0.5, 1.0):
        for hi in ("auto", "int8", "int4"):
            for missing in ("host", "fetch", "auto"):
                rows.append({"residency": "static", "resident_budget_gib": round(free * share, 1),
                             "hi_precision": hi, "missing_expert": missing})
    best = {"residency": "static", "resident_budget_gib": free, "hi_precision": "int8",
            "missing_expert": "auto"}
    rows.append({**best, "expert_batching": "micro", "micro_batch_tokens": 64})
    rows.append({**best, "max_replicas": 1, "replica_threshold": 1.5})
    return rows


def plan(model: str, profiles: list[Any], workload: Any, base: Any, *, max_requests: int | None = None,
         progress: Callable[[str], None] | None = None, slo: Any = None) -> list[dict[str, Any]]:
    """Rows (one per profile and config): knobs, offline tokens/s, p99s at rate x1, capacity at ``slo`` (a
    :class:`tuner.slo.SloSpec`; default: the latency bounds of the tuner's default SLO)."""
    from engine.backend_sim import SimBackend
    from engine.config import ConfigError
    from engine.runner import run_workload
    from tuner.capacity import find_capacity
    from tuner.slo import DEFAULT_SLO, evaluate, parse_slo

    if slo is None:
        slo = parse_slo(data={k: v for k, v in DEFAULT_SLO.items() if not k.startswith("quality")})
    target = slo.attainment_target
    arrivals = [r.arrival_s for r in list(workload.requests)[: max_requests or None]]
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    base_rps = (len(arrivals) - 1) / span if span > 0 else 0.0
    say = progress or (lambda _m: None)
    out = []
    for prof in profiles:
        grid = plan_configs(model, prof, base)
        for i, knobs in enumerate(grid):
            say(f"{prof.name}: config {i + 1}/{len(grid)}")
            cfg = base.replace(**knobs)
            row: dict[str, Any] = {"profile": prof.name, "calibrated": prof.calibrated,
                                   "budget_gib": knobs.get("resident_budget_gib", "all"),
                                   "hi": knobs.get("hi_precision", "auto"),
                                   "missing": knobs.get("missing_expert", "-") if knobs else "-",
                                   "batching": "micro" if knobs.get("expert_batching") == "micro" else "coalesced",
                                   "replicas": knobs.get("max_replicas", 0), "knobs": knobs}
            try:
                sim = SimBackend.from_model(model, cfg, profile=prof)
            except ConfigError as e:
                row["error"] = str(e).removeprefix("sim backend: ")
                out.append(row)
                continue
            off = run_workload(sim, workload, mode="offline", max_requests=max_requests).summary()
            rt = run_workload(sim, workload, mode="realtime", max_requests=max_requests)
            s = rt.summary()

            def attainment_at(scale: float, sim: Any = sim) -> float:
                r = run_workload(sim, workload, mode="realtime", rate_scale=scale, max_requests=max_requests)
                return evaluate(r.requests, r.summary(), r.duration_s, slo).attainment

            cap = (find_capacity(attainment_at, target, 1.0, min_rate_scale=MIN_RATE_SCALE)
                   if target is not None else None)
            row.update(offline_tokens_per_s=off["output_tokens_per_s"], ttft_p99_ms=s.get("ttft_p99_ms"),
                       tpot_p99_ms=s.get("tpot_p99_ms"),
                       capacity_rps=None if cap is None else cap.rate_scale * base_rps,
                       capacity_bounded=None if cap is None else cap.bounded)
            out.append(row)
    return out
