"""Synthetic workloads: seeded arrival processes, length distributions and router traces.

Arrivals: ``poisson`` (rate), ``gamma`` (rate and burstiness CV), ``constant``, ``onoff`` (Poisson
bursts during on-periods, silence during off-periods) and ``offline`` (everything at t = 0).
Lengths are given as a small spec string, see :func:`parse_length_spec`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from workloads.errors import WorkloadError
from workloads.router import SYNTHETIC_PREFIX, RouterTrace
from workloads.schema import Request, Workload, load_workload

ARRIVALS = ("poisson", "gamma", "constant", "onoff", "offline")
DEFAULT_RATE_PER_S = 1.0
DEFAULT_CV = 3.0
DEFAULT_ON_S = 10.0
DEFAULT_OFF_S = 10.0
DEFAULT_PROMPT_LEN = "lognormal:256:0.8:16:2048"
DEFAULT_OUTPUT_LEN = "lognormal:64:0.6:4:512"
ARRIVAL_DECIMALS = 6
"""Arrival times are rounded to microseconds, so a saved workload reloads exactly."""


def arrival_times_s(kind: str, n_requests: int, rng: np.random.Generator, *,
                    rate_per_s: float = DEFAULT_RATE_PER_S, cv: float = DEFAULT_CV, on_s: float = DEFAULT_ON_S,
                    off_s: float = DEFAULT_OFF_S, exact_rate: bool = False) -> np.ndarray:
    """``n_requests`` ascending arrival times in seconds, the first at 0.

    ``rate_per_s`` is the mean rate; for ``onoff`` it is the rate during on-periods (the mean is
    ``rate_per_s * on_s / (on_s + off_s)``). ``cv`` is the coefficient of variation of gamma gaps.
    ``exact_rate`` scales poisson or gamma gaps so the sample's mean rate is exactly ``rate_per_s``
    (small samples otherwise stray far from it).
    """
    if kind not in ARRIVALS:
        raise WorkloadError(f"arrival: {kind!r} is not one of {', '.join(ARRIVALS)}")
    if n_requests < 1:
        raise WorkloadError(f"n_requests: {n_requests} is less than 1")
    if kind != "offline" and not rate_per_s > 0:
        raise WorkloadError(f"rate: {rate_per_s} is not > 0")
    n_gaps = n_requests - 1
    if kind == "onoff":  # a Poisson clock that only runs during on-periods
        if not on_s > 0 or off_s < 0:
            raise WorkloadError(f"onoff: on_s must be > 0 and off_s >= 0, got {on_s} and {off_s}")
        on_clock = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate_per_s, n_gaps))])
        return np.round(on_clock + np.floor(on_clock / on_s) * off_s, ARRIVAL_DECIMALS)
    if kind == "offline":
        gaps = np.zeros(n_gaps)
    elif kind == "constant":
        gaps = np.full(n_gaps, 1.0 / rate_per_s)
    elif kind == "poisson":
        gaps = rng.exponential(1.0 / rate_per_s, n_gaps)
    else:  # gamma
        if not cv > 0:
            raise WorkloadError(f"cv: {cv} is not > 0")
        shape = 1.0 / cv**2  # gamma with shape k has CV 1/sqrt(k)
        gaps = rng.gamma(shape, 1.0 / (rate_per_s * shape), n_gaps)
    if exact_rate and kind in ("poisson", "gamma") and n_gaps and gaps.sum() > 0:
        gaps *= n_gaps / (rate_per_s * gaps.sum())
    return np.round(np.concatenate([[0.0], np.cumsum(gaps)]), ARRIVAL_DECIMALS)


@dataclass(frozen=True)
class LengthSpec:
    """A token-length distribution: fixed, uniform, lognormal or fitted to another workload."""

    kind: str
    """``fixed`` | ``uniform`` | ``lognormal`` | ``fit``."""
    params: tuple[float, ...] = ()
    workload: str | None = None
    """For ``fit``: the workload spec whose empirical lengths are resampled."""
    text: str = ""


def parse_length_spec(text: str, what: str = "length") -> LengthSpec:
    """Parse a length spec.

    ``N`` or ``fixed:N``; ``uniform:LO:HI`` (inclusive); ``lognormal:MEDIAN:SIGMA[:LO:HI]`` (clipped to
    ``[LO, HI]``); ``fit:W`` resamples the lengths of workload ``W`` (a path or ``builtin:NAME``).
    """
    kind, _, rest = text.partition(":")
    if kind.isdigit() and not rest:
        kind, rest = "fixed", kind
    if kind == "fit":
        if not rest:
            raise WorkloadError(f"{what}: {text!r}: fit needs a workload, e.g. fit:builtin:chat")
        return LengthSpec("fit", (), rest, text)
    counts = {"fixed": (1,), "uniform": (2,), "lognormal": (2, 4)}
    if kind not in counts:
        raise WorkloadError(f"{what}: {text!r}: expected N, fixed:N, uniform:LO:HI, "
                            "lognormal:MEDIAN:SIGMA[:LO:HI] or fit:W")
    try:
        params = tuple(float(p) for p in rest.split(":")) if rest else ()
    except ValueError:
        raise WorkloadError(f"{what}: {text!r}: parameters must be numbers") from None
    if len(params) not in counts[kind]:
        raise WorkloadError(f"{what}: {text!r}: {kind} takes {' or '.join(map(str, counts[kind]))} parameters")
    if any(not math.isfinite(p) or p < 0 for p in params) or (kind != "lognormal" and params[0] < 1):
        raise WorkloadError(f"{what}: {text!r}: parameters must be finite, lengths >= 1")
    if kind == "uniform" and params[1] < params[0]:
        raise WorkloadError(f"{what}: {text!r}: HI is less than LO")
    if kind == "lognormal" and (params[0] < 1 or (len(params) == 4 and not 1 <= params[2] <= params[3])):
        raise WorkloadError(f"{what}: {text!r}: need MEDIAN >= 1 and 1 <= LO <= HI")
    return LengthSpec(kind, params, None, text)


def sample_lengths(spec: LengthSpec, n: int, rng: np.random.Generator,
                   fitted: np.ndarray | None = None) -> np.ndarray:
    """``n`` lengths (int64, each >= 1) from ``spec``; ``fitted`` holds the empirical lengths for ``fit``."""
    if spec.kind == "fixed":
        out = np.full(n, round(spec.params[0]))
    elif spec.kind == "uniform":
        out = rng.integers(round(spec.params[0]), round(spec.params[1]) + 1, n)
    elif spec.kind == "lognormal":
        median, sigma = spec.params[:2]
        out = np.rint(np.exp(rng.normal(math.log(median), sigma, n)))
        if len(spec.params) == 4:
            out = np.clip(out, spec.params[2], spec.params[3])
    else:
        if fitted is None or fitted.size == 0:
            raise WorkloadError(f"{spec.text}: the workload to fit has no requests")
        out = fitted[rng.integers(0, fitted.size, n)]
    return np.maximum(np.asarray(out, dtype=np.int64), 1)


def synth_workload(name: str, n_requests: int, *, arrival: str = "poisson",
                   rate_per_s: float = DEFAULT_RATE_PER_S, cv: float = DEFAULT_CV, on_s: float = DEFAULT_ON_S,
                   off_s: float = DEFAULT_OFF_S, prompt_len: str = DEFAULT_PROMPT_LEN,
                   output_len: str = DEFAULT_OUTPUT_LEN, seed: int = 0, tag: str | None = None,
                   exact_rate: bool = False, metadata: Mapping[str, Any] | None = None) -> Workload:
    """A seeded synthetic workload. Arrivals, prompt lengths and output lengths draw from independent
    streams of ``seed``, so changing one distribution leaves the others as they were.

    When both lengths are ``fit`` to the same workload, (prompt, output) pairs are resampled together
    so their correlation is kept. ``exact_rate``: see :func:`arrival_times_s`.
    """
    rng_arrival, rng_prompt, rng_output = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    prompt_spec = parse_length_spec(prompt_len, "prompt length")
    output_spec = parse_length_spec(output_len, "output length")
    arrivals = arrival_times_s(arrival, n_requests, rng_arrival, rate_per_s=rate_per_s, cv=cv, on_s=on_s,
                               off_s=off_s, exact_rate=exact_rate)
    if prompt_spec.kind == "fit" and output_spec.kind == "fit" and prompt_spec.workload == output_spec.workload:
        source = load_workload(prompt_spec.workload or "")
        if len(source) == 0:
            raise WorkloadError(f"{prompt_spec.text}: the workload to fit has no requests")
        pick = rng_prompt.integers(0, len(source), n_requests)
        prompts, outputs = source.prompt_lens[pick], source.output_lens[pick]
    else:
        prompts = sample_lengths(prompt_spec, n_requests, rng_prompt, _fitted(prompt_spec, "prompt"))
        outputs = sample_lengths(output_spec, n_requests, rng_output, _fitted(output_spec, "output"))
    width = len(str(n_requests - 1))
    requests = [Request(f"{name}-{i:0{width}d}", float(a), int(p), int(o), tag=tag)
                for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs, strict=True))]
    meta = {
        "source": "synthetic",
        "origin": "generated by moetune workloads.synth",
        "license": "generated data, no third-party content",
        "seed": seed,
        "arrival": {"kind": arrival, "rate_per_s": rate_per_s, "exact_rate": exact_rate, **({"cv": cv} if arrival == "gamma" else {}),
                    **({"on_s": on_s, "off_s": off_s} if arrival == "onoff" else {})},
        "prompt_len": prompt_len,
        "output_len": output_len,
    }
    meta.update(metadata or {})
    return Workload(name, requests, meta)


def _fitted(spec: LengthSpec, which: str) -> np.ndarray | None:
    if spec.kind != "fit":
        return None
    source = load_workload(spec.workload or "")
    return source.prompt_lens if which == "prompt" else source.output_lens


# ------------------------------------------------------------------------------ router traces


ROUTER_DEFAULTS: dict[str, Any] = {"hidden_size": 0, "skew": 1.0, "drift": 0.1, "drift_window_tokens": 1024,
                                   "layer_corr": 0.5}
"""Defaults of :func:`synth_router_trace`'s shape-free parameters (the CLI reads them from here)."""


def synth_router_trace(requests: Sequence[Request], *, n_layers: int, n_experts: int, top_k: int,
                       moe_layers: Sequence[int] | None = None, hidden_size: int = ROUTER_DEFAULTS["hidden_size"],
                       skew: float = ROUTER_DEFAULTS["skew"], drift: float = ROUTER_DEFAULTS["drift"],
                       drift_window_tokens: int = ROUTER_DEFAULTS["drift_window_tokens"],
                       layer_corr: float = ROUTER_DEFAULTS["layer_corr"], seed: int = 0) -> RouterTrace:
    """A seeded synthetic router trace for the simulator.

    Each MoE layer has Zipf-like expert popularity (share of the expert of rank r ~ 1 / r**skew) with
    its own random ranking. Popularity drifts: every ``drift_window_tokens`` tokens each expert's
    logit takes a Gaussian step of std ``drift``. Layers are correlated token by token: with
    probability ``layer_corr`` a token's first expert at a layer is the one of the same popularity
    rank as its first expert at the layer before (so per-layer shares are kept). Each token gets
    ``prompt_len + max_new_tokens - 1`` routed positions (the last generated token is never fed back).

    The trace's fingerprint starts with ``synthetic:`` so it is never mistaken for a recorded one.
    """
    if not (n_experts >= 1 and 1 <= top_k <= n_experts and n_layers >= 1):
        raise WorkloadError(f"router: need n_layers >= 1 and 1 <= top_k <= n_experts, got n_layers={n_layers}, "
                            f"n_experts={n_experts}, top_k={top_k}")
    if n_experts > np.iinfo(np.int16).max:
        raise WorkloadError(f"router: n_experts={n_experts} does not fit int16 expert ids")
    if not 0 <= layer_corr <= 1 or skew < 0 or drift < 0 or drift_window_tokens < 1:
        raise WorkloadError("router: need 0 <= layer_corr <= 1, skew >= 0, drift >= 0, drift_window_tokens >= 1")
    layers = list(range(n_layers)) if moe_layers is None else [int(v) for v in moe_layers]
    n_moe = len(layers)
    params = {"n_layers": n_layers, "moe_layers": layers, "n_experts": n_experts, "top_k": top_k,
              "skew": skew, "drift": drift, "drift_window_tokens": drift_window_tokens,
              "layer_corr": layer_corr, "seed": seed}
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    identity = {"arch": "synthetic", "n_layers": n_layers, "moe_layers": layers, "n_experts": n_experts,
                "top_k": top_k, "hidden_size": hidden_size, "fingerprint": f"{SYNTHETIC_PREFIX}{digest}",
                "synthetic": params}
    rng = np.random.default_rng(seed)

    lengths = np.array([r.prompt_len + r.max_new_tokens - 1 for r in requests], dtype=np.int64)
    n_tokens = int(lengths.sum())
    ranks = np.stack([rng.permutation(n_experts) for _ in range(n_moe)])  # [L, E]: expert of each rank
    base_logits = np.empty((n_moe, n_experts))
    base_logits[np.arange(n_moe)[:, None], ranks] = -skew * np.log(np.arange(1, n_experts + 1))[None, :]
    # follow[l][e]: the expert at layer l with the same popularity rank as expert e at layer l-1
    follow = np.zeros((n_moe, n_experts), dtype=np.int64)
    for layer in range(1, n_moe):
        follow[layer, ranks[layer - 1]] = ranks[layer]
    n_windows = max(1, math.ceil(n_tokens / drift_window_tokens))
    steps = rng.normal(0.0, drift, (n_windows, n_moe, n_experts))
    steps[0] = 0.0
    logits_by_window = (np.cumsum(steps, axis=0) + base_logits[None]).astype(np.float32)  # [W, L, E]

    expert_ids = np.empty((n_tokens, n_moe, top_k), dtype=np.int16)
    gates = np.empty((n_tokens, n_moe, top_k), dtype=np.float16)
    chunk = max(1, (1 << 21) // max(n_experts, 1))  # bounds the [chunk, E] work arrays
    for lo in range(0, n_tokens, chunk):
        hi = min(lo + chunk, n_tokens)
        window = np.arange(lo, hi) // drift_window_tokens
        rows = np.arange(hi - lo)
        previous_first = None
        for layer in range(n_moe):
            # Gumbel-max trick: the top-k of logits + Gumbel noise is a sample of k experts without replacement.
            noise = rng.random((hi - lo, n_experts), dtype=np.float32)
            with np.errstate(divide="ignore"):
                np.log(noise, out=noise)
                np.negative(noise, out=noise)
                np.log(noise, out=noise)
            noisy = logits_by_window[window, layer, :]  # [T, E]
            noisy -= noise
            if previous_first is not None and layer_corr > 0:
                follows = rows[rng.random(hi - lo) < layer_corr]
                # the followed expert becomes this token's highest-scoring (first) choice
                noisy[follows, follow[layer, previous_first[follows]]] = noisy[follows].max(axis=1) + 0.5
            top = np.argpartition(noisy, n_experts - top_k, axis=1)[:, n_experts - top_k:]  # [T, K]
            order = np.argsort(-np.take_along_axis(noisy, top, axis=1), axis=1, kind="stable")
            top = np.take_along_axis(top, order, axis=1)
            chosen = np.take_along_axis(noisy, top, axis=1)
            weights = np.exp(chosen - chosen.max(axis=1, keepdims=True))
            weights /= weights.sum(axis=1, keepdims=True)
            expert_ids[lo:hi, layer] = top
            gates[lo:hi, layer] = weights
            previous_first = top[:, 0]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return RouterTrace(identity, [r.request_id for r in requests], offsets, expert_ids, gates)
