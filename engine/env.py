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


# OpenMP's idle threads spin briefly, then sleep. A decode step runs about a hundred short parallel regions,
# with a few microseconds of serial work between them. Threads that sleep at once (OMP_WAIT_POLICY=PASSIVE)
# are woken by the kernel at every region, 14-30 us each; threads that spin libgomp's default 300,000
# times hold a core for milliseconds after every barrier, and on a CPU shared with any other process the
# thread they wait for needs that core. The engine spins for about 100 us (engine.spin: the count of pauses
# that last that long on this machine), which bridges the gaps inside a step and sleeps between steps
# (README, "Threads spin briefly, then sleep"). libgomp reads the variables once, when PyTorch loads it, so
# the engine package sets GOMP_SPINCOUNT on import, before anything imports torch; a policy or spin count
# the user set is kept (GOMP_SPINCOUNT overrides OMP_WAIT_POLICY in libgomp, so it is left unset where the
# user chose a policy).
_wait_policy: tuple[str, str] | None = None


def apply_omp_wait_policy() -> tuple[str, str]:
    """Set ``GOMP_SPINCOUNT`` unless the user set it or ``OMP_WAIT_POLICY``, or torch is already loaded;
    ``(value, source)``, the source starting "moetune default" where the engine chose."""
    global _wait_policy
    if _wait_policy is None:
        import sys

        policy, spins = os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT")
        if policy or spins:
            value = ", ".join(([policy.upper()] if policy else []) + ([f"GOMP_SPINCOUNT={spins}"] if spins else []))
            _wait_policy = (value, "environment")
        elif "torch" in sys.modules:
            _wait_policy = ("libgomp default", "torch was imported before the engine")
        else:
            from engine.spin import measured_spin_count

            count, how = measured_spin_count()
            os.environ["GOMP_SPINCOUNT"] = str(count)
            _wait_policy = (f"GOMP_SPINCOUNT={count}", f"moetune default: {how}")
    return _wait_policy


def omp_wait_policy() -> str:
    """The policy this process's OpenMP threads wait with, and who chose it (recorded in every result)."""
    value, source = apply_omp_wait_policy()
    return f"{value} ({source})"
