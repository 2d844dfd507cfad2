"""Watching a run as it goes, to stop it once its verdict against the SLO is certain.

:class:`SloWatch` is ``run_workload``'s ``on_progress`` callback: it reads each request's timeline
so far (:class:`engine.runner.RunProgress`, on the run's own clock, so every time is the one the
final result reports) and returns True (stop the run) once so many requests certainly missed that
the attainment target is out of reach, or, with ``stop_when_met``, once so many certainly met it that
the target is reached whatever the rest do. A capacity probe needs only that verdict, so a replay
rarely runs to its last request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tuner.slo import Progress, SloSpec, certain_meets, certain_misses, target_certain, target_unreachable


def progress_of(requests: Mapping[str, Any], max_new_tokens: Mapping[str, int]) -> list[Progress]:
    """:class:`Progress` of every request of a run from its ``RequestResult``s so far."""
    return [Progress(r.arrival_s, r.first_token_s, r.finish_s, r.output_tokens, r.finish_reason == "rejected",
                     max_new_tokens.get(key)) for key, r in requests.items()]


class SloWatch:
    """The ``on_progress`` callback that stops a run once attainment against the target is decided.

    ``max_new_tokens`` maps each request of the run to its token budget (a request still decoding
    has a TPOT of at least its time so far over that many gaps). ``decision`` becomes ``"missed"`` or
    ``"met"`` (with ``reason``) when it stops the run. Checks at most every ``every_s`` seconds of the
    run's clock (the check walks every request).
    """

    def __init__(self, max_new_tokens: Mapping[str, int], slo: SloSpec, every_s: float = 0.1, *,
                 stop_when_met: bool = False) -> None:
        self.max_new_tokens = dict(max_new_tokens)
        self.limits_ms = slo.request_limits_ms()
        self.target = slo.attainment_target
        self.every_s = every_s
        self.stop_when_met = stop_when_met
        self.decision: str | None = None
        self.reason = ""
        self._last_check_s = -math.inf

    @property
    def enabled(self) -> bool:
        return bool(self.limits_ms) and self.target is not None

    def __call__(self, run: Any) -> bool:
        if not self.enabled or self.decision is not None:
            return self.decision is not None
        if run.now_s - self._last_check_s < self.every_s and run.done < run.total:
            return False
        self._last_check_s = run.now_s
        progress = progress_of(run.requests, self.max_new_tokens)
        n = len(progress)
        misses = certain_misses(progress, run.now_s, self.limits_ms)
        if target_unreachable(n, misses, self.target):
            self.decision = "missed"
            self.reason = (f"stopped after {run.done}/{run.total} requests: {misses} of {n} already missed the "
                           f"SLO, so attainment stays below {self.target:.0%}")
            return True
        if self.stop_when_met:
            meets = certain_meets(progress, self.limits_ms)
            if target_certain(n, meets, self.target):
                self.decision = "met"
                self.reason = (f"stopped after {run.done}/{run.total} requests: {meets} of {n} already met the "
                               f"SLO, so attainment reaches {self.target:.0%}")
                return True
        return False
