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


# OpenMP's idle threads sleep at once instead of spinning. libgomp's default spins for up to 300,000
# iterations at every barrier; on a CPU shared with any other process a spinning thread holds a core the
# thread it waits for needs, and the engine's many short parallel regions per token slow several times
# over (README, "Threads wait passively"). libgomp reads the variable once, when PyTorch loads it, so
# the engine package sets it on import, before anything imports torch; a value the user set is kept.
OMP_WAIT_POLICY_DEFAULT = "PASSIVE"

_wait_policy: tuple[str, str] | None = None


def apply_omp_wait_policy() -> tuple[str, str]:
    """Set ``OMP_WAIT_POLICY`` unless the user did or torch is already loaded; ``(value, source)``."""
    global _wait_policy
    if _wait_policy is None:
        import sys

        if os.environ.get("OMP_WAIT_POLICY"):
            _wait_policy = (os.environ["OMP_WAIT_POLICY"].upper(), "environment")
        elif "torch" in sys.modules:
            _wait_policy = ("libgomp default", "torch was imported before the engine")
        else:
            os.environ["OMP_WAIT_POLICY"] = OMP_WAIT_POLICY_DEFAULT
            _wait_policy = (OMP_WAIT_POLICY_DEFAULT, "moetune default")
    return _wait_policy


def omp_wait_policy() -> str:
    """The policy this process's OpenMP threads wait with, and who chose it (recorded in every result)."""
    value, source = apply_omp_wait_policy()
    return f"{value} ({source})"
