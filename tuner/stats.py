"""Repeated measurements: medians, intervals, gains and noise (pure; no torch, no database).

A figure measured once on a shared machine is one draw of a noisy process. The tuner therefore
measures the default config several times per study (the *noise*), re-runs its top configs and every
baseline interleaved, every other round reversed (A B C C B A A B C ...: :func:`round_order`, so that a
steady drift hits them alike) and reports each gain as a median with
an interval:

- the gain's median is the ratio of the two configs' medians;
- fewer than :data:`BOOTSTRAP_MIN` runs: the interval is the range of every ratio of one config's
  runs to the other's, ``[min(A) / max(B), max(A) / min(B)]``;
- otherwise: a percentile bootstrap of the ratio of medians, each config's runs resampled on their
  own, seeded (the same data give the same interval).

Both are conservative on purpose. Simulated on two identical configs with 10 % run-to-run noise and
10 % drift shared by each round, they report a gain that is not there 5 % (3 runs), 1 % (4) and under
1 % (5 to 10) of the time; the range of per-round ratios would do so 24 % of the time with 3 runs, and
a bootstrap that keeps rounds paired 6 % with 5 to 10. Interleaving still matters: drift then widens
the intervals instead of favouring whichever config ran in the better minutes.

A gain whose interval holds 1 is reported as *no gain beyond noise*, and so is one whose median is
within :data:`MIN_EFFECT` of 1 even when its interval is not: on this project's 2-core machines two
configs that differ only in a knob greedy decoding never reads (``sampling.top_p``), confirmed with 5
interleaved runs each on the tiny model, gave medians 2.4-4.1 % apart with intervals as narrow as
0.95-1.02, and once (in CI) an interval that excluded 1 -- a "loss" that was not there. Such offsets
(memory placement, which core a run landed on, the machine's speed switching between runs) last
longer than one run, so no interval made of runs alone sees them.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

T = TypeVar("T")

BOOTSTRAP_MIN = 5
BOOTSTRAP_SAMPLES = 2000
CONFIDENCE = 0.95
NO_GAIN = "no gain beyond noise"
#: The smallest gain (as a fraction) that can be a verdict: medians closer than this are NO_GAIN.
MIN_EFFECT = 0.05


@dataclass(frozen=True)
class Interval:
    """A median with an interval around it, and how it was made."""

    median: float
    lo: float
    hi: float
    n: int
    method: str  # "min-max" | "bootstrap 95%" | "single"

    def contains(self, x: float) -> bool:
        return self.lo <= x <= self.hi

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def round_order(items: Sequence[T], round_no: int) -> list[T]:
    """The order of interleaved round ``round_no`` (from 0): as given in even rounds, reversed in odd ones
    (A B C, C B A, A B C, ...). Over two rounds every config then sits at the same mean position, so a
    drift linear in time shifts them alike; repeating A B C would put A earliest in every round."""
    return list(items) if round_no % 2 == 0 else list(items)[::-1]


def interval(values: Sequence[float], *, seed: int = 0, confidence: float = CONFIDENCE,
             samples: int = BOOTSTRAP_SAMPLES) -> Interval:
    """The median of ``values`` and an interval around it (see the module docstring).

    The interval always contains the median. Raises ``ValueError`` for no values.
    """
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not xs:
        raise ValueError("no values to summarise")
    med = statistics.median(xs)
    if len(xs) == 1:
        return Interval(med, med, med, 1, "single")
    if len(xs) < BOOTSTRAP_MIN:
        return Interval(med, min(xs), max(xs), len(xs), "min-max")
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(samples))
    tail = (1.0 - confidence) / 2
    lo = meds[int(math.floor(tail * (samples - 1)))]
    hi = meds[int(math.ceil((1.0 - tail) * (samples - 1)))]
    return Interval(med, min(lo, med), max(hi, med), len(xs), f"bootstrap {confidence:.0%}")


def gain_interval(best: Sequence[float | None], baseline: Sequence[float | None], *, seed: int = 0,
                  direction: str = "maximize", samples: int = BOOTSTRAP_SAMPLES,
                  confidence: float = CONFIDENCE) -> Interval | None:
    """How many times better ``best`` is than ``baseline``, with an interval (see the module docstring);
    None unless both have a run and every run of ``baseline`` is positive. For a figure to minimise the
    ratio is inverted (>1 is better)."""
    a_all = [None if v is None else float(v) for v in best]
    b_all = [None if v is None else float(v) for v in baseline]
    if direction != "maximize":
        a_all, b_all = b_all, a_all
    a = [v for v in a_all if v is not None]
    b = [v for v in b_all if v is not None]
    if not a or not b or min(b) <= 0:
        return None
    med = statistics.median(a) / statistics.median(b)
    n = min(len(a), len(b))
    if len(a) == len(b) == 1:
        return Interval(med, med, med, 1, "single")
    if n < BOOTSTRAP_MIN:
        lo, hi = min(a) / max(b), max(a) / min(b)
        return Interval(med, min(lo, med), max(hi, med), n, "min-max")
    rng = random.Random(seed)
    ratios = sorted(statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
                    for _ in range(samples))
    tail = (1.0 - confidence) / 2
    lo = ratios[int(math.floor(tail * (samples - 1)))]
    hi = ratios[int(math.ceil((1.0 - tail) * (samples - 1)))]
    return Interval(med, min(lo, med), max(hi, med), n, f"bootstrap {confidence:.0%}")


def difference_interval(a: Sequence[float | None], b: Sequence[float | None], *, seed: int = 0,
                        samples: int = BOOTSTRAP_SAMPLES, confidence: float = CONFIDENCE) -> Interval | None:
    """``median(a) - median(b)`` with an interval, made as :func:`gain_interval` makes a ratio's: the
    pairwise extremes under :data:`BOOTSTRAP_MIN` runs, else a seeded bootstrap of the two medians."""
    xs = [float(v) for v in a if v is not None]
    ys = [float(v) for v in b if v is not None]
    if not xs or not ys:
        return None
    med = statistics.median(xs) - statistics.median(ys)
    if min(len(xs), len(ys)) < BOOTSTRAP_MIN:
        return Interval(med, min(xs) - max(ys), max(xs) - min(ys), min(len(xs), len(ys)), "min-max")
    rng = random.Random(seed)
    diffs = sorted(statistics.median(rng.choices(xs, k=len(xs))) - statistics.median(rng.choices(ys, k=len(ys)))
                   for _ in range(samples))
    tail = (1.0 - confidence) / 2
    lo = diffs[int(math.floor(tail * (samples - 1)))]
    hi = diffs[int(math.ceil((1.0 - tail) * (samples - 1)))]
    return Interval(med, min(lo, med), max(hi, med), min(len(xs), len(ys)), f"bootstrap {confidence:.0%}")


def verdict(g: Interval | None) -> str:
    """``"gain"``, ``"loss"`` or :data:`NO_GAIN` for a gain interval (None: not measured): a gain needs
    its interval above 1 and its median at least :data:`MIN_EFFECT` above it; a loss the converse."""
    if g is None:
        return "not measured"
    if g.lo > 1.0 and g.median >= 1.0 + MIN_EFFECT:
        return "gain"
    if g.hi < 1.0 and g.median <= 1.0 / (1.0 + MIN_EFFECT):
        return "loss"
    return NO_GAIN


def describe_gain(g: Interval | None, name: str) -> str:
    """``x1.42 over defaults (1.31-1.55, 5 runs each)``, with the verdict when it is not a gain."""
    if g is None:
        return f"over {name}: not measured"
    text = f"x{g.median:.2f} over {name} ({g.lo:.2f}-{g.hi:.2f}, {g.n} runs each)"
    v = verdict(g)
    if v == NO_GAIN and (g.lo > 1.0 or g.hi < 1.0):
        return f"{text}: {NO_GAIN} (under {MIN_EFFECT:.0%})"
    if v == NO_GAIN:
        return f"{text}: {NO_GAIN}"
    if v == "loss":
        return f"{text}: worse beyond noise"
    return text


@dataclass(frozen=True)
class Noise:
    """Run-to-run spread of the objective for one config measured ``n`` times on this machine now."""

    values: tuple[float, ...]
    median: float
    lo: float
    hi: float

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def rel_spread(self) -> float:
        """(max - min) / median: the relative width of the band the repeats fell in."""
        return (self.hi - self.lo) / self.median if self.median > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"values": list(self.values), "median": self.median, "lo": self.lo, "hi": self.hi, "n": self.n,
                "rel_spread": self.rel_spread}


def noise_of(values: Sequence[float | None]) -> Noise | None:
    """The noise of repeated measurements of one config; None with fewer than two values."""
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if len(xs) < 2:
        return None
    return Noise(tuple(xs), statistics.median(xs), min(xs), max(xs))


def relative_spread(values: Sequence[float | None]) -> float | None:
    """(max - min) / median of ``values`` (None with fewer than two, or a median of 0)."""
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if len(xs) < 2:
        return None
    if max(xs) == min(xs):
        return 0.0  # every value the same (every config at 0, say): no spread at all
    med = statistics.median(xs)
    return (max(xs) - min(xs)) / med if med > 0 else None


def expected_range(n: int) -> float:
    """Expected range of ``n`` draws of a standard normal (``d2`` of control charts; Blom's
    approximation, within 5 % of the tabulated values for n >= 2)."""
    if n < 2:
        return 0.0
    return 2.0 * statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def within_noise(values: Sequence[float | None], noise: Noise | None) -> bool | None:
    """Whether ``values`` (one per trial) spread no wider than noise alone would spread them.

    The noise's relative standard deviation is estimated from the range of its ``R`` repeats
    (range / median / d2(R)); ``n`` values of pure noise would span about d2(n) of those. Within that span, no ranking of knobs by
    these values means anything. None when either is unknown.
    """
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    spread = relative_spread(xs)
    if spread == 0.0:
        return True
    if spread is None or noise is None or noise.n < 2 or noise.median <= 0:
        return None
    rel_sigma = noise.rel_spread / expected_range(noise.n)  # relative: slower configs are noisier in req/s
    return spread <= expected_range(len(xs)) * rel_sigma
