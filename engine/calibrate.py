"""Machine calibrations, measured once per machine and software and kept in the cache directory.

- which matrix-product precision is faster here for expert-shaped products (bf16 pays only where the
  CPU has AMX or AVX512_BF16; elsewhere oneDNN emulates it and fp32 wins);
- the host's memory read bandwidth, the roofline's denominator.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch
import torch.nn.functional as F

from engine.env import cache_dir
from engine.hwinfo import hardware

log = logging.getLogger(__name__)


def _store_key() -> str:
    hw = hardware()
    return f"{hw['fingerprint']}-torch{torch.__version__}-threads{torch.get_num_threads()}"


def _load() -> dict[str, Any]:
    path = cache_dir() / "calibration.json"
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}


def _save(data: dict[str, Any]) -> None:
    path = cache_dir() / "calibration.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def cached(name: str, measure) -> Any:
    data = _load()
    key = f"{_store_key()}:{name}"
    if key not in data:
        data[key] = measure()
        _save(data)
    return data[key]


def _time_linear(dtype: torch.dtype, m: int, out_f: int, in_f: int, reps: int = 20) -> float:
    x = torch.randn(m, in_f).to(dtype)
    ws = [torch.randn(out_f, in_f).to(dtype) for _ in range(8)]
    for w in ws:
        F.linear(x, w)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            for w in ws:
                F.linear(x, w)
        best = min(best, time.perf_counter() - t)
    return best / (reps * len(ws))


def cpu_compute_dtype(stored: torch.dtype, hidden: int, inter: int) -> torch.dtype:
    """The faster of ``stored`` (bf16/fp16) and fp32 for expert-shaped products on this CPU.

    Times one token and sixteen tokens per product (decode and prefill); the half-precision type is
    kept only when it is no slower at both.
    """
    if stored == torch.float32:
        return stored
    got = compute_dtype_measurement(stored, hidden, inter)
    log.info("compute dtype on this CPU for %s weights: %s (%s)", stored, got["pick"], got["times_s"])
    return torch.float32 if got["pick"] == "torch.float32" else stored


def compute_dtype_measurement(stored: torch.dtype, hidden: int, inter: int) -> dict[str, Any]:
    """The timings behind :func:`cpu_compute_dtype`: ``times_s`` per token count and dtype, and ``pick``."""

    def measure() -> dict[str, Any]:
        res = {}
        for m in (1, 16):
            res[f"m{m}"] = {str(dt): _time_linear(dt, m, 2 * inter, hidden) for dt in (stored, torch.float32)}
        half_ok = all(r[str(stored)] <= r[str(torch.float32)] for r in res.values())
        return {"times_s": res, "pick": str(stored) if half_ok else "torch.float32"}

    return cached(f"compute_dtype:{stored}:{hidden}x{inter}", measure)


def memory_bandwidth_gbps() -> float:
    """Host DRAM read bandwidth (GB/s) with the current thread count: a sum over a 512 MiB buffer."""

    def measure() -> float:
        buf = torch.ones(128 * 1024 * 1024, dtype=torch.float32)  # 512 MiB, far larger than caches
        buf.sum()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t)
        return buf.numel() * 4 / best / 1e9

    return float(cached("mem_bw_gbps", measure))


def expert_cost_model(spec, dtype: torch.dtype, device: torch.device):
    """Calibrated costs of one expert on the host, on the fast tier and across the link between them.

    Timed on this machine with expert-shaped weights at 1, 8 and 32 tokens (the fit separates a fixed
    overhead, a per-weight-byte and a per-token cost); the link is a host-to-device copy of one expert
    (pinned memory on CUDA; a host memory copy where both tiers are host memory). Cached per machine.
    """
    from engine.moe.policy import CostModel, fit_compute_cost
    from engine.precision import precision_of

    prec = precision_of(dtype)
    h, i = spec.hidden_size, spec.expert_intermediate

    def time_expert(dev: torch.device, tokens: int) -> tuple[int, int, float]:
        w13 = torch.randn(2 * i, h, device=dev).to(dtype)
        w2 = torch.randn(h, i, device=dev).to(dtype)
        x = torch.randn(tokens, h, device=dev).to(dtype)

        def run() -> None:
            gu = F.linear(x, w13)
            F.linear(F.silu(gu[:, :i]) * gu[:, i:], w2)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        run()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t)
        return tokens, (w13.numel() + w2.numel()) * w13.element_size(), best

    def measure() -> dict[str, Any]:
        host = fit_compute_cost([time_expert(torch.device("cpu"), n) for n in (1, 8, 32)])
        dev = host if device.type == "cpu" else fit_compute_cost([time_expert(device, n) for n in (1, 8, 32)])
        nbytes = 3 * h * i * torch.finfo(dtype).bits // 8
        src = torch.empty(nbytes, dtype=torch.uint8)
        if device.type == "cuda":
            src = src.pin_memory()
        src.to(device, copy=True)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            src.to(device, copy=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t)
        return {"default_precision": prec, "link": {"bandwidth_bytes_per_s": nbytes / best, "latency_s": 0.0},
                "host": {prec: host.to_dict()}, "device": {prec: dev.to_dict()}}

    data = cached(f"expert_costs:{device.type}:{prec}:{h}x{i}", measure)
    return CostModel.from_measurements(data)
