"""The numbers a trial reports and the objectives a study may optimise (pure; no torch).

Trial metrics use the results database's column names (``ttft_p99_ms``), not the run summary's
(``ttft_ms_p99``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from engine.results import PERCENTILES

#: Objective name -> direction. ``goodput`` is short for ``goodput_rps``.
OBJECTIVES: dict[str, str] = {
    "goodput_rps": "maximize",
    "goodput_tokens_per_s": "maximize",
    "slo_attainment": "maximize",
    "output_tokens_per_s": "maximize",
    "requests_per_s": "maximize",
    "capacity_rps": "maximize",
    "quality_top1_agreement": "maximize",
    "quality_mean_kl": "minimize",
    "peak_rss_bytes": "minimize",
    **{f"{m}_p{q}_ms": "minimize" for m in ("ttft", "tpot", "e2e", "itl") for q in PERCENTILES},
}
OBJECTIVE_ALIASES = {"goodput": "goodput_rps", "throughput": "output_tokens_per_s", "capacity": "capacity_rps"}
DEFAULT_OBJECTIVE = "goodput_rps"


class ObjectiveError(ValueError):
    """An unknown objective name; one line."""


def parse_objectives(text: str) -> list[str]:
    """``"output_tokens_per_s,tpot_p99_ms"`` -> canonical objective names, checked."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ObjectiveError(f"--objectives {text!r}: expected comma-separated names, e.g. "
                             "output_tokens_per_s,tpot_p99_ms")
    out = []
    for n in names:
        canonical = OBJECTIVE_ALIASES.get(n, n)
        if canonical not in OBJECTIVES:
            raise ObjectiveError(f"--objectives: unknown objective {n!r}; known: "
                                 f"{', '.join([*OBJECTIVE_ALIASES, *OBJECTIVES])}")
        if canonical in out:
            raise ObjectiveError(f"--objectives: {n!r} given twice")
        out.append(canonical)
    return out


def directions(objectives: Sequence[str]) -> list[str]:
    return [OBJECTIVES[o] for o in objectives]


def trial_metrics(summary: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The headline numbers of a run summary under the database's names, plus ``extra``."""
    out: dict[str, Any] = {
        "output_tokens_per_s": summary.get("output_tokens_per_s"),
        "requests_per_s": summary.get("requests_per_s"),
        "duration_s": summary.get("duration_s"),
        "peak_rss_bytes": summary.get("peak_rss_bytes"),
        "quality_top1_agreement": summary.get("quality_top1_agreement"),
        "quality_mean_kl": summary.get("quality_mean_kl"),
    }
    for m in ("ttft", "tpot", "e2e", "itl"):
        for q in PERCENTILES:
            out[f"{m}_p{q}_ms"] = summary.get(f"{m}_ms_p{q}")
    out.update(extra or {})
    return out


def objective_values(metrics: Mapping[str, Any], objectives: Sequence[str]) -> list[float] | str:
    """The objective values of a trial, or a one-line reason when one was not measured."""
    values = []
    for o in objectives:
        v = metrics.get(o)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return f"objective {o} was not measured in this run"
        values.append(float(v))
    return values


def better(a: float, b: float, direction: str) -> bool:
    return a > b if direction == "maximize" else a < b


def gain(best: float | None, baseline: float | None, direction: str) -> float | None:
    """How many times better ``best`` is than ``baseline`` (>1 better), None when undefined."""
    if best is None or baseline is None:
        return None
    if direction == "maximize":
        return best / baseline if baseline > 0 else (math.inf if best > 0 else None)
    return baseline / best if best > 0 else None


def dominates(a: Sequence[float], b: Sequence[float], dirs: Sequence[str]) -> bool:
    """Pareto dominance: ``a`` no worse than ``b`` in every objective and better in one."""
    no_worse = all(not better(y, x, d) for x, y, d in zip(a, b, dirs, strict=True))
    return no_worse and any(better(x, y, d) for x, y, d in zip(a, b, dirs, strict=True))


def pareto_ranks(points: Sequence[Sequence[float]], dirs: Sequence[str]) -> list[int]:
    """Non-dominated sorting: rank 0 is the Pareto front, rank 1 the front once it is removed, ..."""
    ranks = [-1] * len(points)
    remaining = set(range(len(points)))
    rank = 0
    while remaining:
        front = {i for i in remaining
                 if not any(dominates(points[j], points[i], dirs) for j in remaining if j != i)}
        for i in front:
            ranks[i] = rank
        remaining -= front
        rank += 1
    return ranks
