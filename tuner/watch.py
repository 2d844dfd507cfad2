"""Watching a run as it goes, to stop a trial that can no longer meet its SLO.

``run_workload``'s ``on_step(done, total)`` says how many requests finished, not when each got its
tokens. :class:`WatchedEngine` stands in for the engine during a run: it forwards everything and
notes, per request, when it was added, got its first token and finished. Its clock starts no
earlier than the runner's, so every time it reports is a lower bound of the runner's own figure
and a miss it counts is a miss in the final result.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from tuner.slo import Progress, SloSpec, certain_misses, target_unreachable


class CutShort(Exception):  # noqa: N818 - reads as what happened to the trial
    """Raised from a run's step callback: the trial cannot meet the SLO any more."""


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
        if seq.finish_reason == "rejected" and key in self.progress:
            self.progress[key].rejected = True
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
    """The ``on_step`` callback that raises :class:`CutShort` once attainment cannot reach the target.

    Checks at most every ``every_s`` seconds (the check walks every request).
    """

    def __init__(self, watched: WatchedEngine, slo: SloSpec, every_s: float = 0.2) -> None:
        self.watched = watched
        self.limits_ms = slo.request_limits_ms()
        self.target = slo.attainment_target
        self.every_s = every_s
        self._last_check_s = -math.inf

    @property
    def enabled(self) -> bool:
        return bool(self.limits_ms) and self.target is not None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now_s = self.watched.elapsed_s()
        if now_s - self._last_check_s < self.every_s:
            return
        self._last_check_s = now_s
        n = len(self.watched.progress)
        misses = certain_misses(self.watched.progress.values(), now_s, self.limits_ms)
        if target_unreachable(n, misses, self.target):
            raise CutShort(
                f"cut short after {done}/{total} requests: {misses} of {n} already missed the SLO, "
                f"so attainment stays below {self.target:.0%}")
