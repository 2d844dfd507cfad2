"""The numbers a trial reports and the objectives a study may optimise (pure; no torch).

Every name comes from the one metrics table, ``engine.metrics.METRICS``: a metric with a direction
is an objective.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from engine.metrics import METRICS, column_metrics
from engine.metrics import read as read_metric

#: Objective name -> direction: every metric of the table that has one.
OBJECTIVES: dict[str, str] = {m.name: m.direction for m in METRICS.values() if m.direction is not None}
OBJECTIVE_ALIASES = {"goodput": "goodput_rps", "throughput": "output_tokens_per_s", "capacity": "capacity_rps"}
#: The default objective: capacity at the SLO (realtime replays with per-request latency bounds);
#: offline replays default to throughput.
DEFAULT_OBJECTIVE = "capacity_rps"
OFFLINE_OBJECTIVE = "output_tokens_per_s"
#: Objectives whose value depends on per-request latency bounds: they keep the latency constraints.
LATENCY_OBJECTIVES = ("goodput_rps", "goodput_tokens_per_s", "slo_attainment")


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
    """The ``mt_trials`` metrics of a run summary (old spellings read too), plus ``extra``."""
    out: dict[str, Any] = {m.name: read_metric(summary, m.name) for m in column_metrics()}
    out.update(extra or {})
    return out


def latency_constraints(objectives: Sequence[str], mode: str) -> bool:
    """Whether per-request latency bounds and the attainment floor are constraints of a study.

    Not under the capacity objective (they define its knee: the rate is what is measured), and not in
    an offline replay unless an objective itself depends on them (goodput, attainment).
    """
    if "capacity_rps" in objectives:
        return False
    return mode != "offline" or any(o in LATENCY_OBJECTIVES for o in objectives)


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
