"""The environment the engine sets for itself: how OpenMP's threads wait, as libgomp itself reports it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.spin import FALLBACK_SPIN_COUNT, spin_count

SHOW = "import engine, torch; from engine.hwinfo import software; torch.ones(8).sum(); print(software()['omp_wait_policy'])"


# Unset, libgomp displays 'PASSIVE' yet spins 300,000 times at a barrier; GOMP_SPINCOUNT tells them apart.
# This process imported the engine, which set the spin count in its environment: the children start without.
def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return subprocess.run([sys.executable, "-c", code], env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env},
                          capture_output=True, text=True, timeout=120, check=True)


def _with_kernels(cache) -> str:
    """A cache holding this process's kernels library and nothing else (``software()`` reports the kernels: a
    cache without them would build them again, minutes on 2 cores, which is not what these tests are about)."""
    from engine import kernels

    lib = Path(str(kernels.status()["library"]))
    shutil.copytree(lib.parent, Path(cache) / "kernels" / lib.parent.name)
    return str(cache)


def test_engine_makes_openmp_threads_spin_about_100_us_before_torch_loads_libgomp(tmp_path):
    r = _run(SHOW, MOETUNE_CACHE=_with_kernels(tmp_path))  # a cache without the probe: it is built on this import
    m = re.fullmatch(r"GOMP_SPINCOUNT=(\d+) \(moetune default: 100 us of ([\d.]+) ns pauses\)", r.stdout.strip())
    assert m, r.stdout
    count, pause = int(m[1]), float(m[2])
    assert f"GOMP_SPINCOUNT = '{count}'" in r.stderr  # libgomp's own account of what it spins
    assert 0.1 < pause < 1000
    assert count == spin_count(pause)
    assert list(tmp_path.glob("probe/*/pause_probe.so"))  # built once, then loaded from the cache
    again = _run(SHOW, MOETUNE_CACHE=str(tmp_path))
    assert again.stdout.startswith("GOMP_SPINCOUNT=") and "moetune default: 100 us of" in again.stdout


def test_without_a_c_compiler_the_spin_count_falls_back_and_says_why(tmp_path):
    r = _run(SHOW, MOETUNE_CACHE=str(tmp_path), PATH=str(tmp_path))  # no cc, gcc or clang on the path
    assert f"GOMP_SPINCOUNT = '{FALLBACK_SPIN_COUNT}'" in r.stderr
    assert r.stdout.strip() == f"GOMP_SPINCOUNT={FALLBACK_SPIN_COUNT} (moetune default: pause not timed: no C compiler)"


@pytest.mark.parametrize(("pause_ns", "count"), [(11.0, 9100), (12.4, 8100), (50.0, 2000), (300.0, 1000),
                                                 (0.5, 100000), (0.0, 100000)])
def test_the_spin_count_is_100_us_of_pauses_to_two_figures_within_its_range(pause_ns, count):
    assert spin_count(pause_ns) == count


@pytest.mark.parametrize("value", ["active", "PASSIVE"])
def test_a_policy_the_user_set_is_kept_and_recorded(value):
    r = _run(SHOW, OMP_WAIT_POLICY=value)
    assert f"OMP_WAIT_POLICY = '{value.upper()}'" in r.stderr
    assert ("GOMP_SPINCOUNT = '0'" in r.stderr) == (value.upper() == "PASSIVE")
    assert r.stdout.strip() == f"{value.upper()} (environment)"


@pytest.mark.parametrize("env", [{"GOMP_SPINCOUNT": "50"}, {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "7"}])
def test_a_spin_count_the_user_set_is_kept_and_recorded(env):
    r = _run(SHOW, **env)
    assert f"GOMP_SPINCOUNT = '{env['GOMP_SPINCOUNT']}'" in r.stderr  # libgomp: the count wins over the policy
    policy = f"{env['OMP_WAIT_POLICY'].upper()}, " if "OMP_WAIT_POLICY" in env else ""
    assert r.stdout.strip() == f"{policy}GOMP_SPINCOUNT={env['GOMP_SPINCOUNT']} (environment)"


def test_torch_imported_first_is_recorded_not_hidden():
    r = _run(SHOW.replace("import engine, torch", "import torch, engine"))
    assert "GOMP_SPINCOUNT = '300000'" in r.stderr  # libgomp's default: spin, then sleep
    assert r.stdout.strip() == "libgomp default (torch was imported before the engine)"


# A tensor of 8 MiB: PyTorch's allocator advises huge pages for it where THP_MEM_ALLOC_ENABLE is set. smaps
# shows the advice as the mapping's "hg" flag (whether the kernel then backs it with huge pages depends on its
# THP mode and free memory, so the advice is what is checked).
HUGE = """import engine, torch
from engine.hwinfo import software
x = torch.ones(2 << 20)
p, flags, inside = x.data_ptr(), '', False
lines = open('/proc/self/smaps').read().splitlines()
for i, line in enumerate(lines):
    head = line.split()
    if '-' in head[0] and all(c in '0123456789abcdef-' for c in head[0]):
        lo, hi = (int(v, 16) for v in head[0].split('-'))
        inside = lo <= p < hi
    elif inside and line.startswith('VmFlags:'):
        flags = line
print(' hg' in flags, software()['huge_pages'], sep='|')
"""


def _huge(code: str = HUGE, **env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=120, check=True).stdout.strip().split("|")


def test_engine_asks_pytorch_for_huge_pages_for_its_large_tensors_and_records_it():
    advised, record = _huge()
    assert advised == "True"
    assert re.fullmatch(r"THP_MEM_ALLOC_ENABLE=1 \(moetune default; kernel THP \w+\)", record), record


def test_huge_pages_the_user_turned_off_stay_off_and_torch_first_is_recorded():
    advised, record = _huge(THP_MEM_ALLOC_ENABLE="0")
    assert advised == "False" and record.startswith("THP_MEM_ALLOC_ENABLE=0 (environment; kernel THP ")
    out = _huge(HUGE.replace("import engine, torch\n", "import torch, engine\n"))
    assert out[0] == "False" and out[1].startswith("off (torch was imported before the engine; kernel THP ")


@pytest.mark.parametrize("pause_ns", [12.96, 12.94, 11.05, 0.04])
def test_the_recorded_pause_reproduces_the_spin_count_it_chose(monkeypatch, pause_ns):
    # 12.94 ns is 7700 spins but was recorded as 12.9 ns, which is 7800 (CI, 2026-12-06): the count must follow
    # from the pause as recorded
    import engine.spin as spin

    monkeypatch.setattr(spin, "pause_ns", lambda: pause_ns)
    count, how = spin.measured_spin_count()
    recorded = float(re.fullmatch(r"100 us of ([\d.]+) ns pauses", how)[1])
    assert count == spin_count(recorded)
