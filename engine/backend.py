"""The step interface every backend offers, the clocks that drive it, and the backend factory.

:func:`engine.runner.run_workload` drives any :class:`Backend`: it ``start``s a run, ``add``s each
request when the :class:`Clock` reaches its arrival, ``step``s while the backend ``has_work`` and
``finish``es the run (``abort`` drops a request when the caller stops the run early); ``describe``
says what ran (model, device, precisions, which backend) and ``reconfigure`` applies a new config
between runs. Two backends implement it:

- ``live`` (:class:`engine.backend_live.LiveBackend`): the torch engine, on the wall clock;
- ``stub`` (:class:`engine.backend_stub.StubBackend`): the same scheduler and the same expert plans,
  routed token by token from a router trace, with no tensors, on a virtual clock that jumps to the
  next arrival. It prices nothing (every step takes 0 s);
- ``sim`` (:class:`engine.backend_sim.SimBackend`): the stub's decisions, each step priced by a
  hardware profile (:mod:`engine.sim`), on the virtual clock; it routes from synthetic routing with
  the model's hotness when the workload has no router trace, and needs only a model's config.

No torch here: a backend without tensors imports this module alone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from engine.config import EngineConfig
from engine.model.arch import ModelSpec
from engine.moe.policy.plan import TierStats
from engine.results import ExpertStat
from engine.sequences import Sequence, StepOutcome

if TYPE_CHECKING:
    from workloads.router import RouterTrace

BackendKind = Literal["live", "stub", "sim"]
BACKENDS: tuple[BackendKind, ...] = ("live", "stub", "sim")


class Clock(Protocol):
    """Seconds since the run started; ``wait_until`` idles until a time, ``advance`` accounts a step."""

    real: bool
    """True for the wall clock (telemetry is sampled against it)."""

    def start(self) -> None: ...

    def now(self) -> float: ...

    def wait_until(self, t_s: float) -> None: ...

    def advance(self, seconds: float) -> None: ...


class WallClock:
    """The wall clock: waiting sleeps; a step's time has passed by the time it returns."""

    real = True

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def wait_until(self, t_s: float) -> None:
        time.sleep(max(0.0, t_s - self.now()))

    def advance(self, seconds: float) -> None:
        pass  # the step took its time already


class VirtualClock:
    """A clock that moves only when told: waiting jumps to the time, a step adds its priced seconds."""

    real = False

    def __init__(self) -> None:
        self._now = 0.0

    def start(self) -> None:
        self._now = 0.0

    def now(self) -> float:
        return self._now

    def wait_until(self, t_s: float) -> None:
        self._now = max(self._now, t_s)

    def advance(self, seconds: float) -> None:
        self._now += seconds


@dataclass(frozen=True)
class RunStart:
    """What a run asks of the backend before its first request: the workload's router trace (its
    hotness places static and dynamic residency; the stub routes from it), whether to record the
    routes of every processed token, and whether to keep the decision log."""

    source: str
    trace: RouterTrace | None = None
    record_routes: bool = False
    decisions: bool = False


@dataclass
class RunTail:
    """What a backend hands back at the end of a run."""

    expert_stats: Seq[ExpertStat]  # a list, or engine.results.ExpertStats made when first read
    tiers: TierStats | None = None  # None when no hybrid executor ran (the plain engine)
    fast_tier_expert_bytes: int | None = None
    routes: dict[str, tuple[Any, Any]] | None = None  # request key -> (ids [T, L, K] int16, gates float16)
    decisions: list[dict[str, Any]] | None = None
    peak_device_mem_bytes: int | None = None
    extra_meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    """What :func:`engine.runner.run_workload` needs from a backend (see the module docstring)."""

    kind: str

    @property
    def spec(self) -> ModelSpec: ...

    @property
    def config(self) -> EngineConfig: ...

    def model_identity(self) -> dict[str, Any]: ...

    def clock(self) -> Clock: ...

    def start(self, run: RunStart) -> None: ...

    def add(self, key: str, prompt: list[int], max_new_tokens: int) -> Sequence: ...

    def abort(self, key: str) -> Sequence | None: ...

    @property
    def has_work(self) -> bool: ...

    def step(self) -> StepOutcome: ...

    def reconfigure(self, config: EngineConfig) -> float: ...

    def describe(self) -> dict[str, Any]: ...

    def finish(self) -> RunTail: ...


def make_backend(model: str | Path, config: EngineConfig | None = None, kind: BackendKind = "live",
                 **options: Any) -> Backend:
    """A backend for ``model`` (a checkpoint directory or ``builtin:<arch>-<preset>``) with ``config``.

    ``kind="live"`` loads the model (options: ``cost_model``, a calibrated
    :class:`~engine.moe.policy.CostModel` to use instead of this machine's). ``kind="stub"`` reads
    only the checkpoint's config and router fingerprint (options: ``trace`` to route from instead of
    the workload's, ``weight_precision`` of the experts as loaded, ``cost_model`` for
    ``missing_expert=auto``). ``kind="sim"`` needs ``profile`` (a :class:`~engine.sim.profile.Profile`,
    a profile file or ``builtin:<name>``); ``model`` may also be ``shape:<name>`` or a directory holding
    only a ``config.json`` (options: ``trace``, ``cost_model``, ``routing``: synthetic routing when the
    workload has no trace).
    """
    if kind == "live":
        from engine.backend_live import LiveBackend
        from engine.runtime import Engine

        return LiveBackend(Engine(model, config, cost_model=options.pop("cost_model", None)), **options)
    if kind == "stub":
        from engine.backend_stub import StubBackend

        return StubBackend.from_checkpoint(model, config, **options)
    if kind == "sim":
        from engine.backend_sim import SimBackend

        if options.get("profile") is None:
            raise ValueError("the sim backend needs a profile (--profile FILE or builtin:<name>)")
        return SimBackend.from_model(model, config, **options)
    raise ValueError(f"backend kind {kind!r} is not one of {', '.join(BACKENDS)}")


def as_backend(obj: Any) -> Backend:
    """``obj`` itself when it is a backend; an engine (or a stand-in for one) wrapped as the live backend."""
    if isinstance(obj, Backend):
        return obj
    from engine.backend_live import LiveBackend

    return LiveBackend(obj)
