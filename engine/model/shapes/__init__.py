"""Built-in model shapes: the real ``config.json`` of released MoE models, shipped without weights.

``shape:<name>`` names one (``shape:qwen3-30b-a3b``, ``shape:mixtral-8x7b``, ``shape:olmoe-1b-7b``);
the simulator plans and prices them before anything is downloaded. No torch here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.model.arch import CheckpointError, ModelSpec, config_fingerprint, spec_from_config

SHAPES_DIR = Path(__file__).resolve().parent
PREFIX = "shape:"


def shape_names() -> list[str]:
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))


def shape_config(name: str) -> tuple[dict[str, Any], Path]:
    """The config dict and file of built-in shape ``name`` (without the ``shape:`` prefix)."""
    path = SHAPES_DIR / f"{name}.json"
    if not path.is_file():
        raise CheckpointError(f"{PREFIX}{name}: unknown model shape (built in: {', '.join(shape_names())})")
    return json.loads(path.read_text()), path


def shape_spec(name: str) -> tuple[ModelSpec, str]:
    """The spec of built-in shape ``name`` and its fingerprint (``shape:<name>:<hash of the config>``)."""
    cfg, path = shape_config(name)
    return spec_from_config(cfg, str(path)), f"{PREFIX}{name}:{config_fingerprint(cfg)}"
