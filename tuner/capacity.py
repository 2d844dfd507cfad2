"""Capacity: the highest arrival-rate scale at which SLO attainment stays at or above a target (pure).

DistServe's goodput at the SLO knee, ``vllm bench sweep serve_sla``'s search for the highest rate that
meets the SLA. Each *probe* replays the workload with its arrival times divided by a rate scale and
reports the share of requests meeting every per-request bound. Attainment falls as the rate rises;
the search brackets the crossing of the target and bisects it on a log scale:

1. *Warm start.* The first probe is at the best capacity known so far (``start``), not at a fixed
   rate, so most searches need no long walk.
2. *Early stop.* Given an ``incumbent`` (the best capacity of the study so far at this fidelity), the
   first probe is at ``incumbent * (1 - margin)``, the margin being the study's measured noise. A
   config that misses the target there cannot beat the incumbent beyond noise: the search stops
   after that one probe (``stopped_early``).
3. *Bracket.* From a probe that met the target, step up by ``first_step`` and square the step each
   time the target is met again, up to doubling (1.25, 1.56, 2, 2, ...); from one that missed, step
   down the same way.
4. *Bisect* the bracket on a log scale until the highest rate met and the lowest missed are within
   ``rel_tol`` of each other, or ``max_probes`` probes were run.

The estimate is the geometric middle of the final bracket, within ``rel_tol / 2`` of the knee; ``lo``
(highest rate met) and ``hi`` (lowest missed) are kept beside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Defaults of :func:`find_capacity`, stated once.
REL_TOL = 0.1
MAX_PROBES = 7
COLD_STEP = 2.0
WARM_STEP = 1.25
MAX_STEP = 2.0
MIN_RATE_SCALE = 1 / 8  # lower rates make probes 8x longer than the recorded trace: report 0 instead
MAX_RATE_SCALE = 4096.0


#: The coarsest bisection a search stops at once the study's noise is measured (a bracket 25 % wide: the
#: estimate within 12 %).
MAX_NOISE_TOL = 0.25


def noise_tolerance(noise_rel_spread: float | None, rel_tol: float) -> float:
    """The bisection tolerance of a search in a study whose noise is measured: half the noise (its relative
    spread), between the study's ``rel_tol`` and :data:`MAX_NOISE_TOL`. A finer bracket buys nothing the
    measurements can show: configs closer than the noise are told apart by the confirmation's repeats,
    not by one search, and every halving of the bracket costs a probe, the longest probes of a slow config.
    Used by searched trials once the noise is measured and by confirmation runs."""
    if noise_rel_spread is None:
        return rel_tol
    return min(MAX_NOISE_TOL, max(rel_tol, noise_rel_spread / 2))


def rerun_step(rel_tol: float) -> float:
    """The first step of a re-run of a config whose capacity is known (noise repeats, confirmation runs):
    one tolerance. Started at the last estimate, a run whose knee moved less than that is over after one
    probe each side; a 1.25 step would bracket it as fast and then bisect twice to a 10 % tolerance.
    Measured on a step curve (`find_capacity`, rel_tol 0.1, knees log-normal around the start): 2.1, 2.6
    and 3.1 probes a run at a spread of 5, 9 and 15 % against 4.0, 4.0 and 4.3 with a 1.25 step."""
    return 1.0 + rel_tol


@dataclass(frozen=True)
class Probe:
    """One replay at ``rate_scale``: its attainment, and whether it met the target."""

    rate_scale: float
    attainment: float
    met: bool
    stopped: bool = False
    """The replay was stopped once the verdict was certain (its attainment is a bound, not a final share)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything the caller wants kept with the probe (duration, requests, percentiles)."""


@dataclass
class Capacity:
    """The result of a search: the estimate, the bracket around it and every probe in run order."""

    rate_scale: float
    """Estimated capacity as a rate scale: the geometric middle of ``[lo, hi]``; ``lo`` when no probe
    missed (a lower bound, ``bounded`` False); 0 when even the lowest rate missed."""
    lo: float | None
    hi: float | None
    probes: list[Probe]
    stopped_early: bool = False
    reason: str = ""

    @property
    def bounded(self) -> bool:
        """Whether the knee was bracketed (a probe missed above every probe that met)."""
        return self.hi is not None


ProbeFn = Callable[[float], "Probe | float"]


def find_capacity(probe: ProbeFn, target: float, start: float = 1.0, *, incumbent: float | None = None,
                  margin: float = 0.0, rel_tol: float = REL_TOL, max_probes: int = MAX_PROBES,
                  first_step: float | None = None, min_rate_scale: float = MIN_RATE_SCALE,
                  max_rate_scale: float = MAX_RATE_SCALE,
                  rate_label: Callable[[float], str] = lambda s: f"rate x{s:.3g}") -> Capacity:
    """Search the highest rate scale whose probe meets ``target`` (see the module docstring).

    ``probe(rate_scale)`` returns a :class:`Probe` or just the attainment. ``first_step`` defaults to
    :data:`WARM_STEP` when the search starts from a known capacity (``incumbent`` given) and to
    :data:`COLD_STEP` otherwise. ``rate_label`` spells a rate scale in the reasons (e.g. in requests/s).
    """
    if not 0 < target <= 1:
        raise ValueError(f"attainment target {target}: must be in (0, 1]")
    if rel_tol <= 0 or max_probes < 1:
        raise ValueError(f"rel_tol={rel_tol}, max_probes={max_probes}: must be > 0 and >= 1")
    probes: list[Probe] = []

    def run(scale: float) -> bool:
        got = probe(scale)
        p = got if isinstance(got, Probe) else Probe(scale, float(got), float(got) >= target)
        probes.append(p)
        return p.met

    step = first_step or (WARM_STEP if incumbent is not None else COLD_STEP)
    lo: float | None = None
    hi: float | None = None
    if incumbent is not None and incumbent > 0:
        bar = max(min_rate_scale, incumbent * (1.0 - max(0.0, min(margin, 0.9))))
        if not run(bar):
            return Capacity(0.0, None, bar, probes, stopped_early=True,
                            reason=f"missed the target at {rate_label(bar)}, the best so far less the noise "
                                   f"margin: cannot beat it")
        lo = bar
    else:
        start = min(max(start, min_rate_scale), max_rate_scale)
        if run(start):
            lo = start
        else:
            hi = start
    # Bracket: widen the step each time the same side comes back.
    while lo is None:
        assert hi is not None
        nxt = max(hi / step, min_rate_scale)  # the floor itself is probed once
        if hi <= min_rate_scale or len(probes) >= max_probes:
            return Capacity(0.0, None, hi, probes,
                            reason=f"missed the target down to {rate_label(hi)}")
        if run(nxt):
            lo = nxt
        else:
            hi = nxt
            step = min(step * step, MAX_STEP)
    while hi is None:
        nxt = min(lo * step, max_rate_scale)
        if lo >= max_rate_scale or len(probes) >= max_probes:
            return Capacity(lo, lo, None, probes, reason=f"met the target up to {rate_label(lo)}, the highest tried")
        if run(nxt):
            lo = nxt
            step = min(step * step, MAX_STEP)
        else:
            hi = nxt
    while hi / lo > (1.0 + rel_tol) * (1.0 + 1e-9) and len(probes) < max_probes:  # a step of 1 + rel_tol is done
        mid = math.sqrt(lo * hi)
        if run(mid):
            lo = mid
        else:
            hi = mid
    return Capacity(math.sqrt(lo * hi), lo, hi, probes)


def probes_needed(ratio: float, rel_tol: float = REL_TOL, first_step: float = COLD_STEP) -> int:
    """The most probes :func:`find_capacity` runs when the knee lies ``ratio`` times above or below its
    start (ignoring ``max_probes``): one at the start, the bracketing steps, then the bisections."""
    ratio = max(ratio, 1.0 / ratio)
    probes, reach, step = 1, 1.0, first_step
    while True:  # each bracketing probe moves one step further, until one lands past the knee
        reach *= step
        width = step
        probes += 1
        if reach >= ratio:
            break
        step = min(step * step, MAX_STEP)
    return probes + max(0, math.ceil(math.log2(math.log(width) / math.log(1.0 + rel_tol))))
