"""Every environment variable moetune reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where built-in models and machine calibrations are kept (``MOETUNE_CACHE``)."""
    root = os.environ.get("MOETUNE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moetune")
    return Path(root)


def db_url() -> str | None:
    """The results database URL given by ``MOETUNE_DB``, if any."""
    return os.environ.get("MOETUNE_DB") or None


def api_key() -> str | None:
    """The key ``engine serve`` requires as ``Authorization: Bearer`` (``MOETUNE_API_KEY``), if any."""
    return os.environ.get("MOETUNE_API_KEY") or None
