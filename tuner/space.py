"""The search space, generated from the engine's knob registry.

Every knob declared with a ``search`` range in ``engine/config.py`` becomes one Optuna parameter,
named by its dotted key (``scheduler.max_batch_seqs``), except:

- knobs pinned by the user (``--fix``), which every trial gets as given;
- knobs that :func:`inert_knobs` reports as doing nothing on this hardware (a host-thread split
  on a machine without the accelerator it splits against, say);
- conditional knobs whose parent knob is pinned to a value that does not activate them.

A conditional knob (:class:`Condition`) is sampled only in trials whose parent takes one of the
activating values, so Optuna sees a tree, not a box. The space has a short stable hash of its
parameter names, types, ranges and conditions; the study name carries it, so a study never mixes
trials drawn from different spaces.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.config import ConfigError, EngineConfig, KnobInfo, knobs

log = logging.getLogger(__name__)

HASH_CHARS = 8


@dataclass(frozen=True)
class Condition:
    """``knob`` is searched only when knob ``parent`` takes one of ``values``."""

    knob: str
    parent: str
    values: tuple[Any, ...]


#: Conditional knobs of the registry. None today; the hybrid engine adds, for example,
#: ``Condition("scheduler.micro_batch_seqs", "scheduler.batching", ("micro",))``.
CONDITIONS: tuple[Condition, ...] = ()

InertRule = Callable[[Mapping[str, Any]], dict[str, str]]

#: Rules that name knobs doing nothing on a machine (``engine.hwinfo.hardware()``), each returning
#: ``{knob key: reason}``. None of today's knobs is inert anywhere; the hybrid engine adds rules such
#: as "the accelerator SM share is inert without a GPU".
INERT_RULES: list[InertRule] = []


def inert_knobs(hardware: Mapping[str, Any], rules: list[InertRule] | None = None) -> dict[str, str]:
    """Knobs that have no effect on ``hardware``, with the reason: ``{knob key: reason}``."""
    out: dict[str, str] = {}
    for rule in INERT_RULES if rules is None else rules:
        out.update(rule(hardware))
    return out


@dataclass(frozen=True)
class Param:
    """One searched knob: its Optuna distribution and, if conditional, what activates it."""

    key: str
    kind: str  # "int" | "float" | "categorical"
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] | None = None
    condition: Condition | None = None
    default: Any = None

    def suggest(self, trial: Any) -> Any:
        """Draw this parameter from an Optuna trial."""
        if self.kind == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices or ()))
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.log,
                                     step=int(self.step or 1))
        return trial.suggest_float(self.key, float(self.low), float(self.high), log=self.log, step=self.step)

    def problem(self, value: Any) -> str | None:
        """Why ``value`` lies outside this parameter's range, or None when it is inside."""
        if self.kind == "categorical":
            return None if value in (self.choices or ()) else f"not one of {list(self.choices or ())}"
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "not a number"
        if self.kind == "int" and not float(value).is_integer():
            return "not an integer"
        assert self.low is not None and self.high is not None
        if not self.low <= value <= self.high:
            return f"outside [{_num(self.low)}, {_num(self.high)}]"
        if self.step and not math.isclose((value - self.low) / self.step,
                                          round((value - self.low) / self.step), abs_tol=1e-9):
            return f"not on the step {_num(self.step)} from {_num(self.low)}"
        return None

    def describe(self) -> dict[str, Any]:
        """JSON-able description (what the space hash covers, plus the default)."""
        d: dict[str, Any] = {"key": self.key, "kind": self.kind}
        if self.kind == "categorical":
            d["choices"] = list(self.choices or ())
        else:
            d.update(low=self.low, high=self.high, log=self.log, step=self.step)
        if self.condition is not None:
            d["when"] = {"parent": self.condition.parent, "values": list(self.condition.values)}
        return d


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def param_from_knob(k: KnobInfo, condition: Condition | None = None) -> Param:
    """The Optuna parameter of a knob with a ``search`` declaration."""
    s = k.search
    assert s is not None
    if s.choices is not None:
        return Param(k.key, "categorical", choices=tuple(s.choices), condition=condition, default=k.default)
    if k.type is bool:
        return Param(k.key, "categorical", choices=(False, True), condition=condition, default=k.default)
    if s.low is None or s.high is None:
        raise ValueError(f"knob {k.key}: search needs low and high, or choices")
    kind = "int" if k.type is int else "float"
    return Param(k.key, kind, low=s.low, high=s.high, log=s.log, step=s.step, condition=condition,
                 default=k.default)


@dataclass(frozen=True)
class SearchSpace:
    """The parameters a study searches, plus what every trial gets regardless (``fixed``)."""

    params: tuple[Param, ...]
    fixed: dict[str, Any] = field(default_factory=dict)
    """Pinned knobs ``{key: value}`` applied on top of the base config in every trial."""
    omitted: dict[str, str] = field(default_factory=dict)
    """Searchable knobs left out, with the reason (pinned, inert, inactive condition)."""

    @property
    def keys(self) -> list[str]:
        return [p.key for p in self.params]

    def param(self, key: str) -> Param:
        for p in self.params:
            if p.key == key:
                return p
        raise KeyError(key)

    def describe(self) -> list[dict[str, Any]]:
        """The parameters as JSON-able dicts, in sampling order."""
        return [p.describe() for p in self.params]

    def space_hash(self) -> str:
        """A short hash of parameter names, types, ranges, choices and conditions.

        Pinned values are part of it too: a study that pinned a knob to another value searches
        another space.
        """
        blob = json.dumps({"params": self.describe(), "fixed": self.fixed}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:HASH_CHARS]

    def active(self, param: Param, values: Mapping[str, Any]) -> bool:
        """Whether ``param`` is sampled given the values drawn so far (its parent's above all)."""
        c = param.condition
        if c is None:
            return True
        parent = values.get(c.parent, self.fixed.get(c.parent))
        return parent in c.values

    def sample(self, trial: Any) -> dict[str, Any]:
        """Draw every active parameter from an Optuna trial: ``{knob key: value}``."""
        values: dict[str, Any] = {}
        for p in self.params:  # parents come before their children (see build_space)
            if self.active(p, values):
                values[p.key] = p.suggest(trial)
        return values

    def problems(self, values: Mapping[str, Any]) -> list[str]:
        """Why ``values`` (``{knob key: value}``) is not a point of this space; empty when it is."""
        out = []
        known = set(self.keys)
        for key in values:
            if key not in known:
                why = self.omitted.get(key, "not searched")
                out.append(f"{key}: {why}")
        for p in self.params:
            if not self.active(p, values):
                if p.key in values:
                    out.append(f"{p.key}: inactive for {p.condition.parent}={values.get(p.condition.parent)!r}"
                               if p.condition else f"{p.key}: inactive")
                continue
            if p.key not in values:
                out.append(f"{p.key}: missing")
                continue
            why = p.problem(values[p.key])
            if why:
                out.append(f"{p.key}={values[p.key]!r}: {why}")
        return out

    def defaults(self, base: EngineConfig) -> dict[str, Any]:
        """The point of the space that ``base`` already is (its values of the active parameters)."""
        flat = flatten(base.to_dict())
        values: dict[str, Any] = {}
        for p in self.params:
            if self.active(p, values):
                values[p.key] = flat[p.key]
        return values

    def to_config(self, values: Mapping[str, Any], base: EngineConfig, source: str = "trial") -> EngineConfig:
        """The validated engine config of a point: ``base``, then pinned knobs, then ``values``.

        Raises :class:`ConfigError` (one line) for combinations the engine rejects.
        """
        data = base.to_dict()
        for key, value in {**self.fixed, **values}.items():
            area, name = key.split(".", 1)
            data[area][name] = value
        return EngineConfig.from_dict(data, source=source)


def flatten(nested: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``{"scheduler": {"max_batch_seqs": 8}}`` -> ``{"scheduler.max_batch_seqs": 8}``."""
    return {f"{area}.{name}": v for area, values in nested.items() for name, v in values.items()}


def parse_fixed(entries: list[str], base: EngineConfig | None = None) -> dict[str, Any]:
    """``["max_batch_seqs=8", "runtime.compute_dtype=float32"]`` -> ``{knob key: checked value}``.

    Raises :class:`ConfigError` (one line) for a malformed entry or an unknown knob or value.
    """
    by_name = {k.name: k for k in knobs()}
    by_key = {k.key: k for k in knobs()}
    out: dict[str, Any] = {}
    for entry in entries:
        name, sep, raw = entry.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ConfigError(f"--fix {entry!r}: expected KNOB=VALUE")
        info = by_key.get(name) or by_name.get(name)
        if info is None:
            raise ConfigError(f"--fix {entry!r}: unknown knob '{name}' (see `engine knobs`)")
        value: Any = raw.strip()
        if info.type in (int, float) and info.choices is None:
            try:
                value = float(value) if info.type is float else int(value)
            except ValueError:
                raise ConfigError(f"--fix {entry!r}: {info.key} must be {info.type.__name__}") from None
        out[info.key] = info.check(value, "--fix")
    # Cross-field checks run on the pinned values together.
    data = (base or EngineConfig()).to_dict()
    for key, value in out.items():
        area, name = key.split(".", 1)
        data[area][name] = value
    EngineConfig.from_dict(data, source="--fix")
    return out


def build_space(
    hardware: Mapping[str, Any],
    *,
    fixed: Mapping[str, Any] | None = None,
    inert: Mapping[str, str] | None = None,
    conditions: tuple[Condition, ...] | None = None,
    registry: list[KnobInfo] | None = None,
) -> SearchSpace:
    """The search space for this machine: every knob with a search range, less pinned and inert ones.

    ``inert`` defaults to :func:`inert_knobs` of ``hardware``; ``conditions`` to :data:`CONDITIONS`;
    ``registry`` to ``engine.config.knobs()`` (tests pass their own).
    """
    fixed = dict(fixed or {})
    inert = dict(inert_knobs(hardware) if inert is None else inert)
    conditions = CONDITIONS if conditions is None else conditions
    registry = knobs() if registry is None else registry
    by_key = {k.key: k for k in registry}
    cond_of: dict[str, Condition] = {}
    for c in conditions:
        for key in (c.knob, c.parent):
            if key not in by_key:
                raise ValueError(f"condition on unknown knob {key!r}")
        cond_of[c.knob] = c

    omitted: dict[str, str] = {}
    candidates: list[KnobInfo] = []
    for k in registry:
        if k.search is None:
            continue
        if k.key in fixed:
            omitted[k.key] = f"pinned to {fixed[k.key]!r}"
        elif k.key in inert:
            omitted[k.key] = f"inert here: {inert[k.key]}"
        else:
            candidates.append(k)
    searched = {k.key for k in candidates}

    params: list[Param] = []
    for k in candidates:
        c = cond_of.get(k.key)
        if c is not None and c.parent not in searched:
            parent_value = fixed.get(c.parent, by_key[c.parent].default)
            if parent_value not in c.values:
                omitted[k.key] = f"inactive: {c.parent}={parent_value!r}"
                continue
            c = None  # the parent is pinned to an activating value: always searched
        params.append(param_from_knob(k, c))
    params = _parents_first(params)
    # A child whose parent left the space (inactive itself) leaves too.
    keep = [p for p in params if p.condition is None or p.condition.parent in {q.key for q in params}]
    for p in params:
        if p not in keep:
            omitted[p.key] = f"inactive: {p.condition.parent if p.condition else '?'} is not searched"
    space = SearchSpace(tuple(keep), fixed, omitted)
    if omitted:
        log.info("search space %s leaves out %s", space.space_hash(), omitted)
    return space


def _parents_first(params: list[Param]) -> list[Param]:
    """Order parameters so that every parent is sampled before its conditional children."""
    done: list[Param] = []
    placed: set[str] = set()
    pending = list(params)
    while pending:
        progressed = False
        for p in list(pending):
            if p.condition is None or p.condition.parent in placed or p.condition.parent not in {
                q.key for q in params
            }:
                done.append(p)
                placed.add(p.key)
                pending.remove(p)
                progressed = True
        if not progressed:
            raise ValueError(f"circular knob conditions among {[p.key for p in pending]}")
    return done
