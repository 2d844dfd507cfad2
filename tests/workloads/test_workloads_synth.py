"""Synthetic workloads: arrival processes, length specs, seeds."""

from __future__ import annotations

import numpy as np
import pytest

from workloads.schema import WorkloadError
from workloads.synth import arrival_times_s, parse_length_spec, sample_lengths, synth_workload


def test_reproducible_by_seed():
    a = synth_workload("s", 50, seed=4)
    b = synth_workload("s", 50, seed=4)
    c = synth_workload("s", 50, seed=5)
    assert a.requests == b.requests and a.requests != c.requests
    assert a.metadata["seed"] == 4 and a.metadata["arrival"]["kind"] == "poisson"


def test_streams_are_independent():
    a = synth_workload("s", 30, seed=1, output_len="10")
    b = synth_workload("s", 30, seed=1, output_len="uniform:5:50")
    np.testing.assert_array_equal(a.arrivals_s, b.arrivals_s)
    np.testing.assert_array_equal(a.prompt_lens, b.prompt_lens)


@pytest.mark.parametrize(("kind", "cv_lo", "cv_hi"), [("poisson", 0.8, 1.2), ("gamma", 2.0, 6.0), ("constant", 0, 1e-9)])
def test_arrival_processes(kind: str, cv_lo: float, cv_hi: float):
    arrivals = arrival_times_s(kind, 4000, np.random.default_rng(0), rate_per_s=5.0, cv=3.0)
    gaps = np.diff(arrivals)
    assert arrivals[0] == 0 and np.all(gaps >= 0)
    assert 4.0 < 1 / gaps.mean() < 6.0
    assert cv_lo <= gaps.std() / gaps.mean() <= cv_hi


def test_onoff_and_offline_and_exact_rate():
    arrivals = arrival_times_s("onoff", 500, np.random.default_rng(0), rate_per_s=10.0, on_s=2.0, off_s=8.0)
    phase = arrivals % 10.0
    assert np.all(phase <= 2.0 + 1e-6)  # nothing arrives during the off-periods
    assert np.all(arrival_times_s("offline", 5, np.random.default_rng(0)) == 0)
    exact = arrival_times_s("gamma", 20, np.random.default_rng(0), rate_per_s=3.0, cv=3.0, exact_rate=True)
    assert 19 / exact[-1] == pytest.approx(3.0, rel=1e-5)


def test_length_specs():
    rng = np.random.default_rng(0)
    assert set(sample_lengths(parse_length_spec("7"), 10, rng)) == {7}
    uniform = sample_lengths(parse_length_spec("uniform:3:5"), 500, rng)
    assert set(uniform) == {3, 4, 5}
    lognormal = sample_lengths(parse_length_spec("lognormal:100:0.5:20:300"), 2000, rng)
    assert lognormal.min() >= 20 and lognormal.max() <= 300 and 85 < np.median(lognormal) < 115
    for bad in ("uniform:5", "lognormal:x:1", "normal:3:4", "uniform:9:3", "0", "fit:"):
        with pytest.raises(WorkloadError):
            parse_length_spec(bad)


def test_fit_to_another_workload():
    w = synth_workload("f", 200, prompt_len="fit:builtin:tiny", output_len="fit:builtin:tiny", seed=2)
    from workloads.schema import load_workload

    tiny = load_workload("builtin:tiny")
    pairs = set(zip(tiny.prompt_lens.tolist(), tiny.output_lens.tolist(), strict=True))
    assert set(zip(w.prompt_lens.tolist(), w.output_lens.tolist(), strict=True)) <= pairs  # resampled jointly
    only_prompt = synth_workload("f", 50, prompt_len="fit:builtin:tiny", output_len="4")
    assert set(only_prompt.prompt_lens.tolist()) <= set(tiny.prompt_lens.tolist())
