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


# PyTorch backs its CPU allocations of 2 MiB and more with transparent huge pages where THP_MEM_ALLOC_ENABLE
# is set (2 MiB-aligned, madvise(MADV_HUGEPAGE)); it reads the variable once, at its first allocation, so
# the engine sets it on import too. The weights then stream through 2 MiB pages instead of 4 KiB ones
# (fewer TLB misses): batch-1 decode of the medium checkpoint on the AMX Xeon, 4 paired runs, 19.0 / 18.9 /
# 19.3 / 18.7 -> 18.1 / 17.9 / 17.6 / 18.3 ms a step; peak RSS unchanged (README, "Huge pages"). Where the
# kernel's THP mode is "never" the advice does nothing; the record says which mode it is.
_huge_pages: tuple[str, str] | None = None


def apply_huge_pages() -> tuple[str, str]:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` unless the user set it or torch is already loaded; ``(value, source)``."""
    global _huge_pages
    if _huge_pages is None:
        import sys

        user = os.environ.get("THP_MEM_ALLOC_ENABLE")
        if user is not None:
            _huge_pages = (f"THP_MEM_ALLOC_ENABLE={user}", "environment")
        elif "torch" in sys.modules:
            _huge_pages = ("off", "torch was imported before the engine")
        else:
            os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
            _huge_pages = ("THP_MEM_ALLOC_ENABLE=1", "moetune default")
    return _huge_pages


def huge_pages() -> str:
    """Whether PyTorch's large CPU allocations ask for huge pages, who chose it, and the kernel's THP mode
    (recorded in every result)."""
    value, source = apply_huge_pages()
    try:
        modes = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split()
        mode = next((m.strip("[]") for m in modes if m.startswith("[")), "unknown")
    except OSError:
        mode = "absent"
    return f"{value} ({source}; kernel THP {mode})"


def omp_wait_policy() -> str:
    """The policy this process's OpenMP threads wait with, and who chose it (recorded in every result)."""
    value, source = apply_omp_wait_policy()
    return f"{value} ({source})"
