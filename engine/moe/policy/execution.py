"""Where a non-resident expert runs: on the host where its weights are, or fetched to the fast tier.

Fiddler / KTransformers style: for each expert missing from the fast tier in a step, compare the
host's compute time with the fetch time (transfer, then compute on the fast tier), both from a
:class:`CostModel` of costs calibrated on the machine. The costs are never built in here: they come
from the engine's calibration through :meth:`CostModel.from_measurements` (or :func:`fit_compute_cost`
on raw timings). Pure and deterministic (the standard library and numpy).

Compute time of one expert over ``tokens`` tokens, with ``expert_bytes`` bytes of weights::

    seconds = overhead_s + weight_s_per_byte * expert_bytes + tokens * token_s_per_byte * expert_bytes

(a fixed launch overhead, one pass over the weights, and work per token proportional to the expert's
size; one set of coefficients per precision, since int8/int4 weights cost more work per byte).
Transfer time of ``n`` bytes: ``latency_s + n / bandwidth_bytes_per_s``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Placement = Literal["resident", "host", "fetch"]
Mode = Literal["host", "fetch", "auto"]
COST_FORMAT = "moetune-cost-model"
COST_FORMAT_VERSION = 1


def _number(where: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{where}: {value!r} is not a number")
    out = float(value)
    if not math.isfinite(out) or out < 0 or (positive and out == 0):
        raise ValueError(f"{where}: {value!r} must be finite and {'> 0' if positive else '>= 0'}")
    return out


@dataclass(frozen=True)
class ComputeCost:
    """Seconds to run one expert: ``overhead_s + weight_s_per_byte * bytes + tokens * token_s_per_byte * bytes``."""

    overhead_s: float
    weight_s_per_byte: float
    token_s_per_byte: float

    def seconds(self, tokens: int, expert_bytes: int) -> float:
        """Predicted seconds for ``tokens`` tokens through an expert of ``expert_bytes`` bytes."""
        return self.overhead_s + expert_bytes * (self.weight_s_per_byte + tokens * self.token_s_per_byte)

    def to_dict(self) -> dict[str, float]:
        return {"overhead_s": self.overhead_s, "weight_s_per_byte": self.weight_s_per_byte,
                "token_s_per_byte": self.token_s_per_byte}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "compute cost") -> ComputeCost:
        for key in ("overhead_s", "weight_s_per_byte", "token_s_per_byte"):
            if key not in data:
                raise ValueError(f"{where}: field {key!r} is missing")
        return cls(*(_number(f"{where}.{key}", data[key])
                     for key in ("overhead_s", "weight_s_per_byte", "token_s_per_byte")))


@dataclass(frozen=True)
class LinkCost:
    """Seconds to move bytes between the tiers: ``latency_s + bytes / bandwidth_bytes_per_s``."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def seconds(self, n_bytes: int) -> float:
        return self.latency_s + n_bytes / self.bandwidth_bytes_per_s

    def to_dict(self) -> dict[str, float]:
        return {"bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "latency_s": self.latency_s}


@dataclass(frozen=True)
class CostModel:
    """Calibrated costs of one machine: host and fast-tier (device) compute per precision, and the link."""

    host: Mapping[str, ComputeCost]
    device: Mapping[str, ComputeCost]
    link: LinkCost
    default_precision: str

    def __post_init__(self) -> None:
        for side in ("host", "device"):
            if self.default_precision not in getattr(self, side):
                raise ValueError(f"cost model: {side} has no costs for default_precision "
                                 f"{self.default_precision!r}")
        if not self.link.bandwidth_bytes_per_s > 0:
            raise ValueError("cost model: link.bandwidth_bytes_per_s must be > 0")

    def _cost(self, side: str, precision: str | None) -> ComputeCost:
        table = getattr(self, side)
        key = self.default_precision if precision is None else precision
        if key not in table:
            raise ValueError(f"cost model: no {side} costs for precision {key!r} (have {sorted(table)})")
        return table[key]

    def host_compute_s(self, tokens: int, expert_bytes: int, precision: str | None = None) -> float:
        """Seconds to compute one expert on the host."""
        return self._cost("host", precision).seconds(tokens, expert_bytes)

    def device_compute_s(self, tokens: int, expert_bytes: int, precision: str | None = None) -> float:
        """Seconds to compute one expert on the fast tier."""
        return self._cost("device", precision).seconds(tokens, expert_bytes)

    def transfer_s(self, n_bytes: int) -> float:
        """Seconds to copy ``n_bytes`` from the host to the fast tier."""
        return self.link.seconds(n_bytes)

    def fetch_s(self, tokens: int, expert_bytes: int, precision: str | None = None) -> float:
        """Seconds to fetch one expert and compute it on the fast tier (not overlapped)."""
        return self.transfer_s(expert_bytes) + self.device_compute_s(tokens, expert_bytes, precision)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; :meth:`from_measurements` reads it back."""
        return {"format": COST_FORMAT, "version": COST_FORMAT_VERSION, "default_precision": self.default_precision,
                "link": self.link.to_dict(),
                "host": {k: v.to_dict() for k, v in sorted(self.host.items())},
                "device": {k: v.to_dict() for k, v in sorted(self.device.items())}}

    @classmethod
    def from_measurements(cls, data: Mapping[str, Any]) -> CostModel:
        """Build from the engine's calibration (the form :meth:`to_dict` writes)::

            {"default_precision": "bf16",
             "link": {"bandwidth_bytes_per_s": ..., "latency_s": ...},
             "host": {"bf16": {"overhead_s": ..., "weight_s_per_byte": ..., "token_s_per_byte": ...}, ...},
             "device": {...same...}}

        Raises ValueError naming the field that is missing or out of range.
        """
        for key in ("default_precision", "link", "host", "device"):
            if key not in data:
                raise ValueError(f"cost model: field {key!r} is missing")
        link = data["link"]
        for key in ("bandwidth_bytes_per_s", "latency_s"):
            if key not in link:
                raise ValueError(f"cost model: field 'link.{key}' is missing")
        sides: dict[str, dict[str, ComputeCost]] = {}
        for side in ("host", "device"):
            if not isinstance(data[side], Mapping) or not data[side]:
                raise ValueError(f"cost model: field {side!r} must map precision -> costs")
            sides[side] = {str(p): ComputeCost.from_dict(c, f"cost model: {side}.{p}")
                           for p, c in sorted(data[side].items())}
        return cls(host=sides["host"], device=sides["device"], default_precision=str(data["default_precision"]),
                   link=LinkCost(_number("cost model: link.bandwidth_bytes_per_s", link["bandwidth_bytes_per_s"],
                                         positive=True),
                                 _number("cost model: link.latency_s", link["latency_s"])))


def fit_compute_cost(samples: Sequence[tuple[int, int, float]]) -> ComputeCost:
    """Least-squares :class:`ComputeCost` from timings ``(tokens, expert_bytes, seconds)``, coefficients >= 0.

    Every subset of the three terms is fitted and the best fit whose coefficients are all >= 0 is
    kept (a small exact non-negative least squares). Timings of a single expert size cannot tell the
    overhead from the per-byte pass; the fit then puts it in ``overhead_s``.
    """
    arr = np.asarray(samples, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] != 3 or arr.shape[0] < 2:
        raise ValueError("samples must be at least two (tokens, expert_bytes, seconds) triples")
    if not np.all(np.isfinite(arr)) or arr.min() < 0:
        raise ValueError("samples must be finite and >= 0")
    tokens, nbytes, secs = arr.T
    columns = np.stack([np.ones_like(secs), nbytes, tokens * nbytes], axis=1)
    scale = np.abs(columns).max(axis=0)
    scale[scale == 0] = 1
    cols = columns / scale
    best: tuple[float, np.ndarray] | None = None
    for size in (1, 2, 3):
        for subset in itertools.combinations(range(3), size):
            sub = cols[:, subset]
            if np.linalg.matrix_rank(sub) < size:
                continue
            coef, *_ = np.linalg.lstsq(sub, secs, rcond=None)
            if np.any(coef < 0):
                continue
            resid = float(np.sum((sub @ coef - secs) ** 2))
            if best is None or resid < best[0] - 1e-18 * max(1.0, float(np.sum(secs ** 2))):
                full = np.zeros(3)
                full[list(subset)] = coef
                best = (resid, full)
    if best is None:
        return ComputeCost(0.0, 0.0, 0.0)
    c = best[1] / scale
    return ComputeCost(float(c[0]), float(c[1]), float(c[2]))


def crossover_tokens(expert_bytes: int, cost: CostModel, precision: str | None = None) -> float:
    """Token count at which fetching costs the same as host compute: fetch wins above it.

    ``math.inf`` when the host is never slower; 0 when fetching is never slower.
    """
    h = cost._cost("host", precision)
    d = cost._cost("device", precision)
    fixed = (cost.transfer_s(expert_bytes) + d.overhead_s + d.weight_s_per_byte * expert_bytes
             - h.overhead_s - h.weight_s_per_byte * expert_bytes)
    slope = (h.token_s_per_byte - d.token_s_per_byte) * expert_bytes
    if slope <= 0:
        return 0.0 if fixed < 0 else math.inf
    return max(fixed / slope, 0.0)


def decide(tokens: int, expert_bytes: int, mode: Mode, cost: CostModel | None = None,
           precision: str | None = None) -> Literal["host", "fetch"]:
    """Where to run one non-resident expert this step.

    ``host`` and ``fetch`` modes return themselves (no cost model needed). ``auto`` compares
    :meth:`CostModel.host_compute_s` with :meth:`CostModel.fetch_s` and takes the cheaper; a tie
    (and zero tokens) goes to the host, which moves no bytes and takes no fast-tier memory.
    """
    if mode in ("host", "fetch"):
        return mode
    if mode != "auto":
        raise ValueError(f"mode must be 'host', 'fetch' or 'auto', got {mode!r}")
    if cost is None:
        raise ValueError("mode 'auto' needs a calibrated cost model")
    if tokens <= 0:
        return "host"
    host = cost.host_compute_s(tokens, expert_bytes, precision)
    fetch = cost.fetch_s(tokens, expert_bytes, precision)
    return "fetch" if fetch < host else "host"


def plan_layer(expert_token_counts: Mapping[int, int], resident: Collection[int], mode: Mode,
               cost: CostModel | None, expert_bytes: int, *, precision: str | None = None,
               fetch_budget_bytes: int | None = None) -> dict[int, Placement]:
    """Placement of every expert with tokens at one layer this step: ``{expert: placement}`` by id.

    Resident experts (any copy on the fast tier, hi or lo) run there (``"resident"``); the others
    follow :func:`decide`. With ``fetch_budget_bytes`` (fast-tier scratch for fetched experts), at
    most ``fetch_budget_bytes // expert_bytes`` experts are fetched, the ones fetching saves the most
    time first (ties: more tokens, then lower id; in ``fetch`` mode the ones with most tokens); the
    rest run on the host.
    """
    if fetch_budget_bytes is not None and fetch_budget_bytes < 0:
        raise ValueError(f"fetch_budget_bytes must be >= 0, got {fetch_budget_bytes!r}")
    resident_set = {int(e) for e in resident}
    out: dict[int, Placement] = {}
    fetch: list[int] = []
    for expert in sorted(int(e) for e, n in expert_token_counts.items() if n > 0):
        if expert in resident_set:
            out[expert] = "resident"
        else:
            out[expert] = decide(int(expert_token_counts[expert]), expert_bytes, mode, cost, precision)
            if out[expert] == "fetch":
                fetch.append(expert)
    if fetch_budget_bytes is not None and fetch:
        slots = int(fetch_budget_bytes) // max(int(expert_bytes), 1)

        def saving(e: int) -> float:
            if cost is None:
                return 0.0
            n = int(expert_token_counts[e])
            return cost.host_compute_s(n, expert_bytes, precision) - cost.fetch_s(n, expert_bytes, precision)

        ranked = sorted(fetch, key=lambda e: (-saving(e), -int(expert_token_counts[e]), e))
        for e in ranked[slots:]:
            out[e] = "host"
    return out
