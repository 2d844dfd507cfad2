"""Watching a run as it goes, to stop it once its verdict against the SLO is certain.

``run_workload``'s ``on_step(done, total)`` says how many requests finished, not when each got its
tokens. :class:`WatchedEngine` stands in for the engine during a run: it forwards everything and
notes, per request, when it was added, got its first token and finished. Its clock starts no
earlier than the runner's, so every time it reports is a lower bound of the runner's own figure
and a miss it counts is a miss in the final result.

:class:`SloWatch` is the ``on_step`` callback: it returns True (stop the run) once so many requests
certainly missed that the attainment target is out of reach, or, with ``stop_when_met``, once so many
certainly met it that the target is reached whatever the rest do. A capacity probe needs only that
verdict, so a replay rarely runs to its last request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from tuner.slo import Progress, SloSpec, certain_meets, certain_misses, target_certain, target_unreachable


class WatchedEngine:
    """Forwards to an ``engine.runtime.Engine`` and keeps a :class:`Progress` per request."""

    def __init__(self, engine: Any, arrivals_s: Mapping[str, float]) -> None:
        self._engine = engine
        self._arrivals_s = dict(arrivals_s)
        # An upper bound of the runner's start time: a request is added no earlier than its arrival.
        self._origin = math.inf
        self.progress: dict[str, Progress] = {k: Progress(a) for k, a in self._arrivals_s.items()}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # The runner may set engine state; it must land on the engine, not on this stand-in.
        if name.startswith("_") or name == "progress":
            object.__setattr__(self, name, value)
        else:
            setattr(self._engine, name, value)

    def add(self, key: str, prompt: list[int], max_new_tokens: int) -> Any:
        self._origin = min(self._origin, time.perf_counter() - self._arrivals_s.get(key, 0.0))
        seq = self._engine.add(key, prompt, max_new_tokens)
        if key in self.progress:
            self.progress[key].max_new_tokens = max_new_tokens
            self.progress[key].rejected = seq.finish_reason == "rejected"
        return seq

    def step(self) -> Any:
        out = self._engine.step()
        now_s = self.elapsed_s()
        for key, _tok in out.tokens:
            p = self.progress.get(key)
            if p is not None:
                if p.first_token_s is None:
                    p.first_token_s = now_s
                p.output_tokens += 1
        for seq in out.finished:
            p = self.progress.get(seq.key)
            if p is not None:
                p.finish_s = now_s
        return out

    def elapsed_s(self) -> float:
        """Seconds since the run started, never more than the runner's own figure."""
        return 0.0 if math.isinf(self._origin) else max(0.0, time.perf_counter() - self._origin)


class SloWatch:
    """The ``on_step`` callback that stops a run once attainment against the target is decided.

    ``decision`` becomes ``"missed"`` or ``"met"`` (with ``reason``) when it stops the run. Checks at
    most every ``every_s`` seconds (the check walks every request).
    """

    def __init__(self, watched: WatchedEngine, slo: SloSpec, every_s: float = 0.1, *,
                 stop_when_met: bool = False) -> None:
        self.watched = watched
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

    def __call__(self, done: int, total: int) -> bool:
        if not self.enabled or self.decision is not None:
            return self.decision is not None
        now_s = self.watched.elapsed_s()
        if now_s - self._last_check_s < self.every_s and done < total:
            return False
        self._last_check_s = now_s
        progress = self.watched.progress.values()
        n = len(self.watched.progress)
        misses = certain_misses(progress, now_s, self.limits_ms)
        if target_unreachable(n, misses, self.target):
            self.decision = "missed"
            self.reason = (f"stopped after {done}/{total} requests: {misses} of {n} already missed the SLO, "
                           f"so attainment stays below {self.target:.0%}")
            return True
        if self.stop_when_met:
            meets = certain_meets(progress, self.limits_ms)
            if target_certain(n, meets, self.target):
                self.decision = "met"
                self.reason = (f"stopped after {done}/{total} requests: {meets} of {n} already met the SLO, "
                               f"so attainment reaches {self.target:.0%}")
                return True
        return False
