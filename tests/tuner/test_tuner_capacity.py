"""The capacity search against synthetic attainment curves, and the statistics of repeated runs (pure)."""

from __future__ import annotations

import math

import pytest

from tuner.capacity import (
    COLD_STEP,
    MAX_NOISE_TOL,
    MAX_PROBES,
    REL_TOL,
    WARM_STEP,
    Probe,
    find_capacity,
    noise_tolerance,
    probes_needed,
    rerun_step,
)
from tuner.stats import (
    MIN_EFFECT,
    NO_GAIN,
    describe_gain,
    gain_interval,
    interval,
    noise_of,
    round_order,
    verdict,
    within_noise,
)


def curve(knee: float, width: float = 0.15):
    """Attainment falling smoothly through 0.9 at ``knee`` (logistic in log rate), like a real replay."""

    def attainment(scale: float) -> float:
        x = math.log(scale / knee) / width
        return 1.0 / (1.0 + math.exp(x - math.log(9.0)))  # = 0.9 at the knee

    return attainment


@pytest.mark.parametrize("knee", [0.2, 0.37, 1.0, 1.7, 3.3, 7.9])
@pytest.mark.parametrize("start", [1.0, 2.5])
def test_finds_the_knee_within_the_tolerance_in_the_stated_probes(knee, start):
    calls = []

    def probe(scale):
        calls.append(scale)
        return curve(knee)(scale)

    got = find_capacity(probe, 0.9, start, max_probes=12)
    assert got.bounded and not got.stopped_early
    # The knee lies in the final bracket, which is within the tolerance...
    assert got.lo <= knee <= got.hi and got.hi / got.lo <= 1 + REL_TOL
    # ...so the estimate (the bracket's geometric middle) is within half of it.
    assert abs(math.log(got.rate_scale / knee)) <= math.log(1 + REL_TOL) / 2 + 1e-9
    assert len(calls) == len(got.probes) <= probes_needed(knee / start, REL_TOL, COLD_STEP)
    assert [p.rate_scale for p in got.probes] == calls
    if 1 / 8 <= knee / start <= 8:  # the default budget covers a knee within 8x of the start
        assert len(calls) <= MAX_PROBES


def test_stated_probe_counts():
    assert probes_needed(1.0) == 1 + 1 + 3  # start, one step past, three bisections of a doubling
    assert probes_needed(8.0) == 1 + 3 + 3 <= MAX_PROBES  # 2, 4, 8: the knee at 8x still fits the default
    assert probes_needed(1.2, first_step=WARM_STEP) <= 4


def test_the_incumbent_stops_a_config_that_cannot_beat_it_after_one_probe():
    seen = []

    def probe(scale):
        seen.append(scale)
        return curve(2.0)(scale)

    # The best so far is at 3.0 with 10 % noise: this config's knee at 2.0 misses at 2.7.
    got = find_capacity(probe, 0.9, incumbent=3.0, margin=0.1)
    assert got.stopped_early and seen == [pytest.approx(2.7)] and got.hi == pytest.approx(2.7)
    assert got.rate_scale == 0.0 and "cannot beat" in got.reason
    # A config within the noise of the incumbent is searched to its knee from there (warm steps).
    seen.clear()
    near = find_capacity(probe, 0.9, incumbent=2.1, margin=0.1)
    assert not near.stopped_early and near.lo <= 2.0 <= near.hi
    assert seen[0] == pytest.approx(1.89) and len(seen) <= probes_needed(2.0 / 1.89, first_step=WARM_STEP)
    # A better one is found above the incumbent.
    better = find_capacity(curve(5.0), 0.9, incumbent=2.0, margin=0.1, max_probes=12)
    assert better.lo <= 5.0 <= better.hi


@pytest.mark.parametrize("knee", [1.02, 1.2, 0.85])
def test_a_confirmation_as_coarse_as_its_first_step_needs_two_probes_near_its_start(knee):
    """A re-run warm-started at its last value, bisecting to a tolerance of its first step (a noisy study's
    confirmation): when the knee moved less than a step, one probe each side ends it (the bracket one step
    wide counts as within the tolerance despite rounding)."""
    tol = noise_tolerance(0.62, REL_TOL)
    assert tol == MAX_NOISE_TOL == WARM_STEP - 1
    got = find_capacity(curve(knee, width=0.01), 0.9, 1.0, first_step=rerun_step(tol), rel_tol=tol)
    assert len(got.probes) == 2 and got.lo <= knee <= got.hi
    assert noise_tolerance(0.1, REL_TOL) == REL_TOL  # a quiet machine: the search's own tolerance
    assert noise_tolerance(0.3, REL_TOL) == pytest.approx(0.15)  # half the noise in between
    assert noise_tolerance(None, REL_TOL) == REL_TOL  # no noise measured


@pytest.mark.parametrize("knee", [1.0, 1.04, 1.09, 0.93])
def test_a_rerun_whose_knee_stayed_within_the_tolerance_takes_one_probe_each_side(knee):
    """Noise repeats and confirmation runs start at the config's last estimate and step by one tolerance:
    two probes where a 1.25 step needs four (bracket, then two bisections down to 10 %), and the estimate
    is as close to the knee as the tolerance promises."""
    got = find_capacity(curve(knee, width=0.01), 0.9, 1.0, first_step=rerun_step(REL_TOL), rel_tol=REL_TOL)
    assert len(got.probes) == 2 and got.lo <= knee <= got.hi
    assert abs(math.log(got.rate_scale / knee)) <= math.log(1 + REL_TOL) / 2 + 1e-9
    assert len(find_capacity(curve(knee, width=0.01), 0.9, 1.0, first_step=WARM_STEP).probes) == 4


def test_a_rerun_whose_knee_moved_far_still_finds_it():
    for knee in (0.31, 2.9):
        got = find_capacity(curve(knee), 0.9, 1.0, first_step=rerun_step(REL_TOL), max_probes=12)
        assert got.lo <= knee <= got.hi and got.hi / got.lo <= 1 + REL_TOL


def test_edges_floor_ceiling_and_probe_objects():
    never = find_capacity(lambda s: 0.0, 0.9, 1.0, min_rate_scale=0.125)
    assert never.rate_scale == 0.0 and never.hi == 0.125 and never.lo is None
    assert [p.rate_scale for p in never.probes] == [1.0, 0.5, 0.25, 0.125]  # halving down to the floor
    always = find_capacity(lambda s: 1.0, 0.9, 1.0, max_probes=3)
    assert not always.bounded and always.rate_scale == always.lo == 4.0 and len(always.probes) == 3
    # A probe stopped once its verdict was certain reports met/missed itself.
    got = find_capacity(lambda s: Probe(s, 0.95 if s <= 2 else 0.5, s <= 2, stopped=True), 0.9, 1.0)
    assert got.lo <= 2.0 <= got.hi and all(p.stopped for p in got.probes)
    with pytest.raises(ValueError):
        find_capacity(lambda s: 1.0, 1.5)


def test_intervals_gains_and_verdicts():
    few = interval([3.0, 1.0, 2.0])
    assert (few.median, few.lo, few.hi, few.method) == (2.0, 1.0, 3.0, "min-max")
    many = interval([1.0, 1.1, 0.9, 1.05, 0.95, 1.02, 0.98])
    assert many.method.startswith("bootstrap") and many.lo <= many.median <= many.hi
    assert many.lo >= 0.9 and many.hi <= 1.1
    assert interval([1.0, 1.1, 0.9, 1.05, 0.95]) == interval([1.0, 1.1, 0.9, 1.05, 0.95])  # seeded
    # Fewer than five runs: the range of every ratio of one config's runs to the other's.
    g = gain_interval([4.0, 4.4, 4.2], [2.0, 2.1, 2.05])
    assert g.median == pytest.approx(4.2 / 2.05) and g.method == "min-max"
    assert (g.lo, g.hi) == (pytest.approx(4.0 / 2.1), pytest.approx(4.4 / 2.0)) and verdict(g) == "gain"
    assert describe_gain(g, "defaults") == "x2.05 over defaults (1.90-2.20, 3 runs each)"
    tie = gain_interval([1.0, 1.1, 0.95], [1.02, 1.0, 1.0])
    assert verdict(tie) == NO_GAIN and describe_gain(tie, "defaults").endswith(NO_GAIN)
    assert verdict(gain_interval([1.0], [2.0])) == "loss"
    assert gain_interval([None], [1.0]) is None and verdict(None) == "not measured"
    assert gain_interval([10.0, 10.0], [20.0, 20.0], direction="minimize").median == 2.0
    # Five or more runs: a bootstrap of the ratio of medians, seeded.
    a, b = [2.0, 2.2, 1.9, 2.1, 2.05], [1.0, 1.05, 0.95, 1.1, 1.0]
    boot = gain_interval(a, b)
    assert boot.method.startswith("bootstrap") and boot == gain_interval(a, b)
    assert boot.median == pytest.approx(2.05) and verdict(boot) == "gain"
    assert 1.7 < boot.lo <= boot.median <= boot.hi < 2.4
    # An offset under MIN_EFFECT is no verdict even when the runs are tight enough to exclude 1.
    near = gain_interval([13.4, 13.5, 13.6, 13.5, 13.4], [13.9, 14.0, 13.95, 14.0, 13.9])
    assert near.hi < 1.0 < 1.0 + MIN_EFFECT and near.median > 1.0 / (1.0 + MIN_EFFECT)
    assert verdict(near) == NO_GAIN and describe_gain(near, "defaults").endswith(f"{NO_GAIN} (under 5%)")
    up = gain_interval([14.0, 14.1, 14.2, 14.1, 14.0], [13.4, 13.5, 13.6, 13.5, 13.4])
    assert up.lo > 1.0 and verdict(up) == NO_GAIN
    clear = gain_interval([14.4, 14.5, 14.6, 14.5, 14.4], [13.4, 13.5, 13.6, 13.5, 13.4])
    assert clear.median > 1.0 + MIN_EFFECT and verdict(clear) == "gain"
    assert verdict(gain_interval([13.4, 13.5, 13.6, 13.5, 13.4], [14.4, 14.5, 14.6, 14.5, 14.4])) == "loss"


def test_reversing_every_other_round_keeps_a_steady_drift_from_favouring_the_first_config():
    """Two identical configs measured while the machine slows down steadily: in A B A B ... the first is
    always measured earlier, so it looks faster in every round; A B B A ... cancels the drift pairwise."""
    assert round_order(["a", "b", "c"], 0) == ["a", "b", "c"] and round_order(["a", "b", "c"], 1) == ["c", "b", "a"]

    def measured(order_of) -> dict[str, list[float]]:
        runs: dict[str, list[float]] = {"a": [], "b": []}
        slot = 0
        for r in range(6):
            for name in order_of(["a", "b"], r):
                runs[name].append(100.0 - 2.0 * slot)  # the same config, 2 % slower each run
                slot += 1
        return runs

    same = measured(lambda items, r: list(items))
    assert all(x > y for x, y in zip(same["a"], same["b"], strict=True))  # A ahead in every round
    fair = measured(round_order)
    assert sum(fair["a"]) == sum(fair["b"])
    assert gain_interval(fair["a"], fair["b"]).median == pytest.approx(1.0, abs=0.02)
    assert verdict(gain_interval(fair["a"], fair["b"])) == NO_GAIN


def test_noise_and_whether_trials_differ_beyond_it():
    noise = noise_of([3.0, 3.3, 3.15])
    assert noise.n == 3 and noise.rel_spread == pytest.approx(0.3 / 3.15)
    assert noise_of([3.0]) is None
    assert within_noise([3.1, 3.2, 3.05, 3.25, 3.0, 3.3], noise)  # six draws of the same noise
    assert not within_noise([1.0, 3.1, 3.2, 6.0], noise)  # a knob that matters
    assert within_noise([1.0, 2.0], None) is None
    assert within_noise([0.0, 0.0, 0.0], None)  # every config the same: nothing to rank
