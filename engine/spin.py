"""How long OpenMP's idle threads spin before they sleep: a time, set as libgomp's count of pauses.

libgomp spins ``GOMP_SPINCOUNT`` iterations of the CPU's pause instruction before a waiting thread sleeps,
and a pause lasts 11 ns on one machine and 20-100 ns on another: 1,000 spins were 20-100 us on this
project's AMD EPYC and 11 us on its AMX Xeon, where a decode step's gaps between parallel regions (15-60
us) then put a thread to sleep 70 times a batch-1 step (README, "Threads spin briefly, then sleep"). So the
engine spins for ``SPIN_TARGET_US``, the pause timed on this machine by a small C probe. The probe must run
before PyTorch loads libgomp, which reads the count once: it is plain C, built once into the cache
(``probe/<hash>/pause_probe.so``) and called through ctypes, with no torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

from engine.env import cache_dir

SPIN_TARGET_US = 100.0  # bridges the gaps inside a step (up to ~60 us), sleeps between steps
FALLBACK_SPIN_COUNT = 1000  # where the pause cannot be timed (no C compiler): the count of 2026-12-04
SPIN_COUNT_RANGE = (1000, 100000)

# One iteration of libgomp's spin (config/linux/wait.h: a relaxed load of the flag, then cpu_relax, which is
# `pause` on x86 and a compiler barrier elsewhere), timed n at a time, best of 5.
PROBE_SOURCE = r"""
#include <time.h>
static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
double pause_ns(long n) {
  static volatile int flag = 0;
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    const double t0 = now_s();
    for (long i = 0; i < n && flag == 0; ++i) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#else
      __asm__ volatile("" ::: "memory");
#endif
    }
    const double dt = now_s() - t0;
    if (dt < best) best = dt;
  }
  return best / (double)n * 1e9;
}
"""
PROBE_PAUSES = 20000  # 0.2-2 ms a round


def _probe_library() -> str:
    """The probe's shared object, compiled on first use; raises OSError/RuntimeError where it cannot be."""
    digest = hashlib.sha256(PROBE_SOURCE.encode()).hexdigest()[:16]
    lib = cache_dir() / "probe" / digest / "pause_probe.so"
    if lib.exists():
        return str(lib)
    cc = next((shutil.which(n) for n in ("cc", "gcc", "clang") if shutil.which(n)), None)
    if cc is None:
        raise RuntimeError("no C compiler")
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, src = tempfile.mkstemp(suffix=".c", dir=lib.parent)
    with os.fdopen(fd, "w") as f:
        f.write(PROBE_SOURCE)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, "-O2", "-shared", "-fPIC", src, "-o", tmp], capture_output=True, text=True,
                             timeout=60, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed on the pause probe: {res.stderr.strip().splitlines()[:1]}")
        os.replace(tmp, lib)  # atomic: a concurrent import sees no half-written library
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        os.unlink(src)
    return str(lib)


def pause_ns() -> float:
    """One iteration of libgomp's spin-wait on this machine, in nanoseconds (measured, about 1-10 ms)."""
    fn = ctypes.CDLL(_probe_library()).pause_ns
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_long]
    return float(fn(PROBE_PAUSES))


def spin_count(pause: float, target_us: float = SPIN_TARGET_US) -> int:
    """Spins that last ``target_us`` at ``pause`` ns each, to two significant figures, within SPIN_COUNT_RANGE."""
    lo, hi = SPIN_COUNT_RANGE
    n = target_us * 1e3 / max(pause, 1e-3)
    n = float(f"{n:.2g}")
    return int(min(hi, max(lo, n)))


def measured_spin_count() -> tuple[int, str]:
    """(spins, how they were chosen): SPIN_TARGET_US of this machine's pauses, or FALLBACK_SPIN_COUNT with the
    reason the pause could not be timed. Never raises: it runs when the engine package is imported."""
    try:
        pause = pause_ns()
    except Exception as e:  # no compiler, an unwritable cache, a foreign platform
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        return FALLBACK_SPIN_COUNT, f"pause not timed: {reason}"
    pause = round(pause, 1)  # the count follows from the pause as recorded, so the record reproduces it
    return spin_count(pause), f"{SPIN_TARGET_US:.0f} us of {pause:.1f} ns pauses"
