"""The knob registry: every engine setting, declared once.

Each area of the engine has one frozen dataclass; each field is declared with :func:`knob`, which
records its default, bounds or choices, a one-line docstring and, where the tuner may search it,
its search range. CLI flags (:func:`add_cli_args`), validation (:meth:`EngineConfig.from_dict`),
``engine knobs`` (:func:`knob_table`), the tuner's search space and exported config files are all
derived from these declarations; nothing else restates a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin


class ConfigError(ValueError):
    """A configuration that cannot work; the message is one line naming the key and the value."""


@dataclass(frozen=True)
class Search:
    """How the tuner searches a knob: a numeric range (``low``..``high``) or a list of choices."""

    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] | None = None


def knob(
    default: Any,
    doc: str,
    *,
    min: float | None = None,  # noqa: A002 - mirrors the registry's vocabulary
    max: float | None = None,  # noqa: A002
    search: Search | None = None,
    behaviour: bool = True,
) -> Any:
    """Declare one knob. ``behaviour=False`` marks knobs that do not change what the engine computes
    or how fast (seeds of reporting, labels) and so stay out of the config hash."""
    meta = {"doc": doc, "min": min, "max": max, "search": search, "behaviour": behaviour}
    if isinstance(default, (list, dict)):
        raise TypeError("knob defaults must be immutable")
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and in which precision the engine computes."""

    device: Literal["auto", "cpu", "cuda"] = knob(
        "auto", "Device for the model: cuda when present under auto, else cpu.")
    compute_dtype: Literal["auto", "checkpoint", "float32", "bfloat16", "float16"] = knob(
        "auto",
        "Precision of matrix products: auto measures bf16 vs fp32 kernels on this machine once and picks "
        "the faster; checkpoint keeps the stored dtype.",
        search=Search(choices=("auto", "checkpoint", "float32")),
    )
    threads: int = knob(
        0, "Host threads for PyTorch ops (0 = every core this process may use).", min=0, max=1024)
    seed: int = knob(0, "Seed for sampling and for synthesised prompt tokens.", min=0, max=2**31 - 1)


@dataclass(frozen=True)
class SchedulerConfig:
    """How requests are batched into steps (continuous batching with chunked prefill)."""

    max_batch_seqs: int = knob(
        32, "Most sequences running in one step (prefill and decode together).", min=1, max=4096,
        search=Search(low=1, high=64, log=True))
    max_batch_tokens: int = knob(
        1024, "Most tokens (prefill chunk tokens + one per decoding sequence) in one step.", min=1,
        max=1 << 20, search=Search(low=64, high=4096, log=True))
    prefill_chunk_tokens: int = knob(
        512, "Longest piece of one prompt prefilled in one step; longer prompts prefill over several steps.",
        min=1, max=1 << 20, search=Search(low=32, high=2048, log=True))
    max_seq_len_tokens: int = knob(
        4096, "Longest sequence (prompt + output) the KV cache holds; longer requests are rejected.",
        min=2, max=1 << 22)


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen (requests may not override these yet)."""

    temperature: float = knob(0.0, "Softmax temperature; 0 means greedy decoding.", min=0.0, max=100.0)
    top_k: int = knob(0, "Sample only among the k most likely tokens (0 = all).", min=0, max=1 << 20)
    top_p: float = knob(1.0, "Sample only among the smallest set of tokens whose mass reaches p.",
                        min=0.0, max=1.0)
    ignore_eos: bool = knob(
        True, "Keep generating past the end-of-sequence token until max_new_tokens (workload replay "
        "needs the recorded output lengths).")


AREAS: dict[str, type] = {
    "runtime": RuntimeConfig,
    "scheduler": SchedulerConfig,
    "sampling": SamplingConfig,
}


@dataclass(frozen=True)
class KnobInfo:
    """One knob as the rest of moetune sees it (CLI, tuner, dashboard, ``engine knobs``)."""

    area: str
    name: str
    type: Any
    default: Any
    doc: str
    min: float | None
    max: float | None
    choices: tuple[Any, ...] | None
    search: Search | None
    behaviour: bool

    @property
    def key(self) -> str:
        return f"{self.area}.{self.name}"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def range_text(self) -> str:
        if self.choices is not None:
            return "|".join(str(c) for c in self.choices)
        if self.type is bool:
            return "true|false"
        lo = "" if self.min is None else _num(self.min)
        hi = "" if self.max is None else _num(self.max)
        return f"[{lo}, {hi}]"

    def check(self, value: Any, source: str) -> Any:
        """Coerce ``value`` to the knob's type and check it, or raise a one-line ConfigError."""
        where = f"{source}: {self.key}={value!r}"
        if self.choices is not None:
            if value not in self.choices:
                raise ConfigError(f"{where}: must be one of {', '.join(map(str, self.choices))}")
            return value
        if self.type is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in {"true", "false", "1", "0", "yes", "no"}:
                return value.lower() in {"true", "1", "yes"}
            raise ConfigError(f"{where}: must be true or false")
        try:
            if self.type is int:
                if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                    raise ValueError
                coerced: Any = int(value)
            elif self.type is float:
                if isinstance(value, bool):
                    raise ValueError
                coerced = float(value)
            else:
                coerced = self.type(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: must be {self.type.__name__}") from None
        if self.min is not None and coerced < self.min:
            raise ConfigError(f"{where}: below the minimum {_num(self.min)}")
        if self.max is not None and coerced > self.max:
            raise ConfigError(f"{where}: above the maximum {_num(self.max)}")
        return coerced


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _knob_info(area: str, cls: type, f: dataclasses.Field) -> KnobInfo:
    hints = typing.get_type_hints(cls)
    tp = hints[f.name]
    choices = None
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        tp = type(choices[0])
    meta = f.metadata
    return KnobInfo(area, f.name, tp, f.default, meta["doc"], meta["min"], meta["max"], choices,
                    meta["search"], meta["behaviour"])


def knobs() -> list[KnobInfo]:
    """Every knob of every area, in declaration order."""
    return [_knob_info(area, cls, f) for area, cls in AREAS.items() for f in dataclasses.fields(cls)]


def _knobs_by_name() -> dict[str, KnobInfo]:
    out: dict[str, KnobInfo] = {}
    for k in knobs():
        if k.name in out:  # flat names are CLI flags: they must be unique across areas
            raise RuntimeError(f"knob name {k.name} declared in two areas")
        out[k.name] = k
    return out


@dataclass(frozen=True)
class EngineConfig:
    """The whole engine configuration: one instance of each area."""

    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {area: dataclasses.asdict(getattr(self, area)) for area in AREAS}

    def config_hash(self) -> str:
        """Short hash of every knob that changes behaviour; keys caches and de-duplicates results."""
        flat = {k.key: getattr(getattr(self, k.area), k.name) for k in knobs() if k.behaviour}
        blob = json.dumps(flat, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **flat: Any) -> EngineConfig:
        """A copy with knobs changed by flat name (``max_batch_seqs=8``), validated."""
        data = self.to_dict()
        for area, values in _nest(flat, "replace()").items():
            data[area].update(values)
        return EngineConfig.from_dict(data, source="replace()")

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> EngineConfig:
        """Build and validate a config from nested (``{"scheduler": {...}}``) or flat keys.

        Unknown keys and out-of-range values raise :class:`ConfigError` naming the key and value.
        """
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        nested = _nest(data, source)
        by_name = _knobs_by_name()
        parts: dict[str, dict[str, Any]] = {area: {} for area in AREAS}
        for area, values in nested.items():
            for name, value in values.items():
                info = by_name[name]
                parts[area][name] = info.check(value, source)
        cfg = cls(**{area: AREAS[area](**vals) for area, vals in parts.items()})
        cfg.validate(source)
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> EngineConfig:
        """Load a JSON config file; a tuner export (with an ``engine_config`` key) works too."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{p}: no such config file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
        if isinstance(data, dict) and "engine_config" in data:
            data = data["engine_config"]
        return cls.from_dict(data, source=str(p))

    def validate(self, source: str = "config") -> None:
        """Cross-field checks; each error names the fields and their values."""
        s = self.scheduler
        if s.max_batch_seqs > s.max_batch_tokens:
            raise ConfigError(
                f"{source}: scheduler.max_batch_seqs={s.max_batch_seqs} exceeds "
                f"scheduler.max_batch_tokens={s.max_batch_tokens} (each decoding sequence needs a token)")


def _nest(data: dict[str, Any], source: str) -> dict[str, dict[str, Any]]:
    """Accept nested area dicts, dotted keys and flat knob names; reject anything else."""
    by_name = _knobs_by_name()
    out: dict[str, dict[str, Any]] = {area: {} for area in AREAS}
    for key, value in data.items():
        if key in AREAS:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {key}={value!r}: expected an object of knobs")
            for name, v in value.items():
                if name not in by_name or by_name[name].area != key:
                    raise ConfigError(f"{source}: unknown key '{key}.{name}' (value {v!r})")
                out[key][name] = v
            continue
        name = key.split(".", 1)[1] if "." in key else key
        area = key.split(".", 1)[0] if "." in key else None
        if name not in by_name or (area is not None and by_name[name].area != area):
            raise ConfigError(f"{source}: unknown key '{key}' (value {value!r})")
        out[by_name[name].area][name] = value
    return out


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per knob; unset flags stay None so a config file or the default applies."""
    group = parser.add_argument_group("engine knobs (see `engine knobs`)")
    for k in knobs():
        kwargs: dict[str, Any] = {"default": None, "dest": f"knob__{k.name}",
                                  "help": f"{k.doc} Default {k.default}; range {k.range_text()}."}
        if k.choices is not None:
            kwargs["choices"] = k.choices
        else:
            kwargs["metavar"] = k.type.__name__.upper()
        group.add_argument(k.flag, **kwargs)


def config_from_args(args: argparse.Namespace, base: EngineConfig | None = None) -> EngineConfig:
    """Apply CLI flags on top of ``base`` (a config file or the defaults)."""
    base = base or EngineConfig()
    flat = {name[len("knob__"):]: v for name, v in vars(args).items()
            if name.startswith("knob__") and v is not None}
    if not flat:
        return base
    data = base.to_dict()
    for name, value in flat.items():
        data[_knobs_by_name()[name].area][name] = value
    return EngineConfig.from_dict(data, source="command line")


def knob_table() -> list[dict[str, Any]]:
    """Rows for ``engine knobs``: key, default, range, search range and meaning."""
    rows = []
    for k in knobs():
        s = k.search
        if s is None:
            search = ""
        elif s.choices is not None:
            search = "|".join(map(str, s.choices))
        else:
            search = f"{_num(s.low)}..{_num(s.high)}" + (" log" if s.log else "")
        rows.append({"knob": k.key, "flag": k.flag, "type": k.type.__name__, "default": k.default,
                     "range": k.range_text(), "search": search, "doc": k.doc})
    return rows
