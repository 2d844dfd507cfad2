"""The server's settings, declared once like the engine's knobs (``engine.config.knob``).

They are not engine knobs: they change neither a run's results nor its speed, so they stay out of
:class:`engine.config.EngineConfig`, its hash, the tuner's space and exported configs. CLI flags
(:func:`add_serve_args`) and validation (:func:`serve_config_from_args`) come from these fields.
The API key is a secret, not a setting: ``--api-key`` or ``MOETUNE_API_KEY`` (``engine.env``).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

from engine.config import KnobInfo, knob


@dataclass(frozen=True)
class ServeConfig:
    """How ``engine serve`` listens and how much it queues."""

    host: str = knob("127.0.0.1", "Address to bind; 127.0.0.1 serves this machine only.")
    port: int = knob(8000, "TCP port to listen on (0 = any free port, printed at start).", min=0, max=65535)
    served_model_name: str = knob(
        "", "Model id in /v1/models and in requests' `model` field (empty = the --model argument).")
    max_waiting_requests: int = knob(
        64, "Requests that may wait for a free sequence slot (scheduler.max_batch_seqs run at once); "
        "beyond that a request gets 429 with Retry-After.", min=0, max=1 << 20)
    retry_after_s: int = knob(1, "Seconds a 429 answer's Retry-After header asks the client to wait.",
                              min=0, max=3600)
    max_body_bytes: int = knob(
        1 << 20, "Largest request body accepted; larger ones get 413.", min=1024, max=1 << 30)
    http_thread_nice: int = knob(
        10, "Linux niceness of the HTTP thread above the engine loop's: where the engine's threads fill "
        "the CPU, its steps go first and HTTP work takes the gaps (0 = the same priority).", min=0, max=19)
    access_log: bool = knob(False, "Log every HTTP request (uvicorn's access log).")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = knob(
        "info", "uvicorn's log level.")


def serve_knobs() -> list[KnobInfo]:
    """The settings as :class:`engine.config.KnobInfo`, in declaration order."""
    hints = typing.get_type_hints(ServeConfig)
    out = []
    for f in dataclasses.fields(ServeConfig):
        tp: Any = hints[f.name]
        choices = None
        if get_origin(tp) is Literal:
            choices = get_args(tp)
            tp = type(choices[0])
        m = f.metadata
        out.append(KnobInfo("serve", f.name, tp, f.default, m["doc"], m["min"], m["max"], choices, m["search"],
                            m["behaviour"], m["when"], m["needs"]))
    return out


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per setting; unset flags stay None so the declared default applies."""
    group = parser.add_argument_group("server settings")
    for k in serve_knobs():
        kwargs: dict[str, Any] = {"default": None, "dest": f"serve__{k.name}",
                                  "help": f"{k.doc} Default {k.default!r}; range {k.range_text()}."}
        if k.choices is not None:
            kwargs["choices"] = k.choices
        else:
            kwargs["metavar"] = k.type.__name__.upper()
        group.add_argument(k.flag, **kwargs)


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The settings given on the command line, each checked (one-line ``ConfigError``)."""
    values = {}
    for k in serve_knobs():
        v = getattr(args, f"serve__{k.name}", None)
        if v is not None:
            values[k.name] = k.check(v, "command line")
    return ServeConfig(**values)
