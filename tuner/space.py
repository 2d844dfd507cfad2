"""The search space, generated from the engine's knob registry.

Every knob declared with a ``search`` range in ``engine/config.py`` becomes one Optuna parameter,
named by its dotted key (``scheduler.max_batch_seqs``), except:

- knobs pinned by the user (``--fix``), which every trial gets as given;
- knobs that :func:`inert_knobs` reports as doing nothing on this hardware (a host-thread split
  on a machine without the accelerator it splits against, say);
- conditional knobs whose parent knob is pinned to a value that does not activate them.

A conditional knob is sampled only in trials whose parents take activating values (the registry's
``when`` declarations, plus :data:`CONDITIONS`), so Optuna sees a tree, not a box. The space has a short stable hash of its
parameter names, types, ranges and conditions; the study name carries it, so a study never mixes
trials drawn from different spaces.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.config import (
    EP_HONOURS,
    HOTNESS_RESIDENCIES,
    ConfigError,
    EngineConfig,
    KnobInfo,
    knobs,
    merge_flat,
    uses_hotness,
)
from engine.precision import int4_groups_dividing

log = logging.getLogger(__name__)

HASH_CHARS = 8


@dataclass(frozen=True)
class Condition:
    """``knob`` is searched only when knob ``parent`` takes one of ``values``."""

    knob: str
    parent: str
    values: tuple[Any, ...]


#: Conditions beyond those the registry declares with ``knob(..., when={...})`` (none today), e.g.
#: ``Condition("execution.micro_batch_tokens", "execution.expert_batching", ("micro",))``.
CONDITIONS: tuple[Condition, ...] = ()

InertRule = Callable[[Mapping[str, Any]], dict[str, str]]

def _registry_rule(hardware: Mapping[str, Any]) -> dict[str, str]:
    """The registry's own verdict (``engine.config.inert_knobs``, from each knob's ``needs``)."""
    from engine import config

    rule = getattr(config, "inert_knobs", None)
    return dict(rule(bool(hardware.get("gpu")))) if rule is not None else {}


#: Rules that name knobs doing nothing on a machine (``engine.hwinfo.hardware()``), each returning
#: ``{knob key: reason}``: the registry's ``needs`` (GPU-only knobs, knobs that need a fast tier
#: apart from the host), and any a later engine adds here.
def _ep_rule(hardware: Mapping[str, Any]) -> dict[str, str]:
    from engine.parallel import inert_here

    return inert_here(hardware)


INERT_RULES: list[InertRule] = [_registry_rule, _ep_rule]


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
    when: tuple[Condition, ...] = ()
    """Conditions on searched parents, all of which must hold for this parameter to be sampled."""
    default: Any = None

    def suggest(self, trial: Any) -> Any:
        """Draw this parameter from an Optuna trial."""
        if self.kind == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices or ()))
        assert self.low is not None and self.high is not None
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
        if self.when:
            d["when"] = {c.parent: list(c.values) for c in self.when}
        return d


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def param_from_knob(k: KnobInfo, when: tuple[Condition, ...] = ()) -> Param:
    """The Optuna parameter of a knob with a ``search`` declaration."""
    s = k.search
    assert s is not None
    if s.choices is not None:
        return Param(k.key, "categorical", choices=tuple(s.choices), when=when, default=k.default)
    if k.type is bool:
        return Param(k.key, "categorical", choices=(False, True), when=when, default=k.default)
    if s.low is None or s.high is None:
        raise ValueError(f"knob {k.key}: search needs low and high, or choices")
    kind = "int" if k.type is int else "float"
    return Param(k.key, kind, low=s.low, high=s.high, log=s.log, step=s.step, when=when, default=k.default)


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
        """Whether ``param`` is sampled given the values drawn so far (its parents' above all).

        A parent that is itself inactive (absent from ``values``) turns its children off.
        """
        return all(c.parent in values and values[c.parent] in c.values for c in param.when)

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
                    parents = ", ".join(f"{c.parent}={values.get(c.parent)!r}" for c in p.when)
                    out.append(f"{p.key}: inactive for {parents}")
                continue
            if p.key not in values:
                out.append(f"{p.key}: missing")
                continue
            problem = p.problem(values[p.key])
            if problem:
                out.append(f"{p.key}={values[p.key]!r}: {problem}")
        return out

    def defaults(self, base: EngineConfig) -> dict[str, Any]:
        """The point of the space that ``base`` already is (its values of the active parameters)."""
        flat = flatten(base.to_dict())
        values: dict[str, Any] = {}
        for p in self.params:
            if self.active(p, values):
                values[p.key] = flat[p.key]
        return values

    def may_place_by_hotness(self, base: EngineConfig) -> bool:
        """Whether some trial of this space places experts from a hotness profile (static or dynamic
        residency, an expert-parallel placement by load): the tuner then counts hotness once per study."""
        if uses_hotness(self.to_config({}, base, source="the study's start")):
            return True
        for p in self.params:
            if p.key == "experts.residency" and set(p.choices or ()) & set(HOTNESS_RESIDENCIES):
                return True
            if p.key == "parallel.ep_placement" and set(p.choices or ()) - {"contiguous"}:
                return True
        return False

    def to_config(self, values: Mapping[str, Any], base: EngineConfig, source: str = "trial") -> EngineConfig:
        """The validated engine config of a point: ``base``, then pinned knobs, then ``values``.

        Raises :class:`ConfigError` (one line) for combinations the engine rejects.
        """
        data = merge_flat(base.to_dict(), {**self.fixed, **values}, source)
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
    EngineConfig.from_dict(merge_flat((base or EngineConfig()).to_dict(), out, "--fix"), source="--fix")
    return out


def registry_conditions(registry: list[KnobInfo]) -> list[Condition]:
    """The conditions the registry declares (``knob(..., when={"parent": (values...)})``)."""
    by_name = {k.name: k for k in registry}
    out = []
    for k in registry:
        for parent, values in (getattr(k, "when", None) or {}).items():
            p = by_name.get(parent) or next((q for q in registry if q.key == parent), None)
            if p is None:
                raise ValueError(f"knob {k.key}: condition on unknown knob {parent!r}")
            out.append(Condition(k.key, p.key, tuple(values)))
    return out


def build_space(
    hardware: Mapping[str, Any],
    *,
    fixed: Mapping[str, Any] | None = None,
    base: EngineConfig | None = None,
    inert: Mapping[str, str] | None = None,
    conditions: tuple[Condition, ...] | None = None,
    registry: list[KnobInfo] | None = None,
    widths: tuple[int, ...] = (),
) -> SearchSpace:
    """The search space for this machine: every knob with a search range, less pinned and inert ones.

    ``fixed`` pins knobs; ``base`` (default: the engine defaults) gives the values of knobs not
    searched, which decide conditions on them. ``inert`` defaults to :func:`inert_knobs` of
    ``hardware``; ``conditions`` adds to the registry's own (default :data:`CONDITIONS`);
    ``registry`` defaults to ``engine.config.knobs()`` (tests pass their own). ``widths`` (the model's
    hidden size and expert width) keeps only the int4 group sizes that divide them: a size that does
    not is a config the engine refuses, a trial spent for nothing.
    """
    fixed = dict(fixed or {})
    inert = dict(inert_knobs(hardware) if inert is None else inert)
    registry = knobs() if registry is None else registry
    extra = CONDITIONS if conditions is None else conditions
    by_key = {k.key: k for k in registry}
    base_values = flatten(base.to_dict()) if base is not None else {}
    when_of: dict[str, list[Condition]] = {}
    for c in [*registry_conditions(registry), *extra]:
        for key in (c.knob, c.parent):
            if key not in by_key:
                raise ValueError(f"condition on unknown knob {key!r}")
        when_of.setdefault(c.knob, []).append(c)

    omitted: dict[str, str] = {}
    candidates: dict[str, KnobInfo] = {}
    for k in registry:
        if k.search is None:
            continue
        if k.key in fixed:
            omitted[k.key] = f"pinned to {fixed[k.key]!r}"
        elif k.key in inert:
            omitted[k.key] = f"inert here: {inert[k.key]}"
        else:
            candidates[k.key] = k

    def static_value(key: str) -> Any:
        return fixed.get(key, base_values.get(key, by_key[key].default))

    # Conditions on knobs that are not searched are decided now; a knob whose condition fails is
    # out, which may in turn decide its own children: repeat until nothing changes.
    changed = True
    while changed:
        changed = False
        for key in list(candidates):
            for c in when_of.get(key, ()):
                if c.parent not in candidates and static_value(c.parent) not in c.values:
                    omitted[key] = f"inactive: {c.parent}={static_value(c.parent)!r}"
                    del candidates[key]
                    changed = True
                    break
    cores = hardware.get("cpu_cores")
    if cores:
        # Thread counts above the cores this process may use only oversubscribe: search up to them.
        for key, k in candidates.items():
            if k.name.endswith("_threads") and k.search is not None and k.search.high is not None:
                candidates[key] = dataclasses.replace(
                    k, search=dataclasses.replace(k.search, high=min(k.search.high, cores)))
    group = candidates.get("experts.int4_group_size")
    if widths and group is not None and group.search is not None and group.search.choices is not None:
        fits = int4_groups_dividing(widths, tuple(group.search.choices))
        if fits:
            candidates[group.key] = dataclasses.replace(group, search=dataclasses.replace(group.search, choices=fits))
        else:
            omitted[group.key] = f"no int4 group size divides the model's widths {list(widths)}"
            del candidates[group.key]
    gpus = int((hardware.get("gpu") or {}).get("count") or 0)
    ep = candidates.get("parallel.ep_size")
    if ep is not None and ep.search is not None and ep.search.choices is not None:
        # More ranks than GPUs is a config error on CUDA (one GPU a rank): search the counts this machine has.
        fits = tuple(c for c in ep.search.choices if c <= max(gpus, 1))
        candidates["parallel.ep_size"] = dataclasses.replace(ep, search=dataclasses.replace(ep.search, choices=fits))
        if any(c > 1 for c in fits):
            # Expert parallelism runs every expert resident on its rank: the hybrid executor's knobs act
            # only at one rank (the engine refuses them beside ep_size > 1, a trial spent for nothing).
            for key, k in candidates.items():
                if k.executor and key not in EP_HONOURS:
                    when_of.setdefault(key, []).append(Condition(key, "parallel.ep_size", (1,)))
    params = [param_from_knob(k, tuple(c for c in when_of.get(k.key, ()) if c.parent in candidates))
              for k in candidates.values()]
    space = SearchSpace(tuple(_parents_first(params)), fixed, omitted)
    if omitted:
        log.info("search space %s leaves out %s", space.space_hash(), omitted)
    return space


def _parents_first(params: list[Param]) -> list[Param]:
    """Order parameters so that every parent is sampled before its conditional children."""
    done: list[Param] = []
    placed: set[str] = set()
    pending = list(params)
    while pending:
        ready = [p for p in pending if all(c.parent in placed for c in p.when)]
        if not ready:
            raise ValueError(f"circular knob conditions among {[p.key for p in pending]}")
        for p in ready:
            done.append(p)
            placed.add(p.key)
            pending.remove(p)
    return done
