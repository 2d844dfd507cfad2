"""The environment the engine sets for itself: how OpenMP's threads wait, as libgomp itself reports it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SHOW = "import engine, torch; from engine.hwinfo import software; torch.ones(8).sum(); print(software()['omp_wait_policy'])"


# Unset, libgomp displays 'PASSIVE' yet spins 300,000 times at a barrier; GOMP_SPINCOUNT tells them apart.
# This process imported the engine, which set the spin count in its environment: the children start without.
def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return subprocess.run([sys.executable, "-c", code], env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env},
                          capture_output=True, text=True, timeout=120, check=True)


def test_engine_makes_openmp_threads_spin_briefly_before_torch_loads_libgomp():
    r = _run(SHOW)
    assert "GOMP_SPINCOUNT = '1000'" in r.stderr  # libgomp's own account: 1,000 spins, then sleep
    assert r.stdout.strip() == "GOMP_SPINCOUNT=1000 (moetune default)"


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
