"""Machine calibrations, measured once per machine and software and kept in the cache directory.

- which matrix-product precision is faster here for expert-shaped products (bf16 pays only where the
  CPU has AMX or AVX512_BF16; elsewhere oneDNN emulates it and fp32 wins);
- the host's memory read bandwidth, the roofline's denominator, and an accelerator's own (its memory,
  the host link and its matrix products' peak) for steps that run there;
- which path each precision's products take per token count on moetune's native kernels (ISA variant
  and arithmetic mode) or PyTorch's GEMM, and the peak FLOP/s of each path (the compute roofline);
- from how many tokens a router's fp32 product is faster on PyTorch's GEMM than on the native kernels.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path
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


def cached(name: str, measure, fresh: bool = False) -> Any:
    """``measure()``, kept per machine, software and thread count; ``fresh`` measures again and keeps that."""
    data = _load()
    key = f"{_store_key()}:{name}"
    if fresh or key not in data:
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


def cpu_compute_dtype(stored: torch.dtype, hidden: int, inter: int, cpu_kernels: str = "torch") -> torch.dtype:
    """What ``compute_dtype=auto`` computes in on this CPU for weights stored in ``stored``.

    Where the native kernels run (``cpu_kernels`` not ``torch`` and the library loads): fp32 activations,
    the weights read as stored, because the kernels' path table already measured every product path on
    this machine, PyTorch's bf16 products among them, and takes the fastest per token count; a whole-model
    choice of PyTorch's bf16 would throw that table away (x0.17 at batch-1 decode on an AVX512_BF16 EPYC,
    where PyTorch's bf16 beats its fp32 but not the kernels). Otherwise (PyTorch alone): the faster of
    ``stored`` and fp32 for expert-shaped products, timed at one and sixteen tokens per product (decode
    and prefill); the half-precision type is kept only when it is no slower at both.
    """
    if stored == torch.float32:
        return stored
    if cpu_kernels != "torch":
        from engine import kernels

        # native: the kernels or an error; a build that fails: an error too (runtime.pick_weight_dtype says why)
        if stored in kernels.HALF_DTYPES and (cpu_kernels == "native" or kernels.load() is not None
                                              or kernels.status()["state"] == "broken"):
            return torch.float32
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


def largest_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest CPU cache this machine reports (Linux sysfs: cpu0's cache levels, sizes such as "2048K"),
    0 where it reports none."""
    best = 0
    for size in root.glob("index*/size"):
        try:
            text = size.read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if text[-1:].upper() in "KMG" else text
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


def bandwidth_buffer_bytes() -> int:
    """The buffer memory_bandwidth_gbps reads: 512 MiB, or four times the largest cache where that is larger
    (a 480 MiB last-level cache held part of a 512 MiB buffer: 37.0 against 36.2 GB/s for 2 GiB, AMX Xeon,
    2026-12-06), at most an eighth of the memory."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf, or not these names: no cap
        memory = 0
    want = max(512 << 20, 4 * largest_cache_bytes())
    return want if memory <= 0 else max(64 << 20, min(want, memory // 8))


def memory_bandwidth_gbps(fresh: bool = False) -> float:
    """Host DRAM read bandwidth (GB/s) with the current thread count: the fastest of reads of a buffer far
    larger than the caches (bandwidth_buffer_bytes): PyTorch's sum (one stream a thread) and, where the native
    kernels load, their ``stream_read`` both ways (several streams far apart as the products of a few tokens
    read their weights, prefetched as they prefetch, and without the prefetches), so that no product reads
    faster than the roofline's bandwidth. ``fresh``: measure now (on a shared machine the bandwidth drifts; a
    measuring command's roofline should use the bandwidth of its own run)."""
    from engine import kernels

    def best_s(read) -> float:
        read()
        return min(_timed(read) for _ in range(5))

    def measure() -> float:
        buf = torch.ones(bandwidth_buffer_bytes() // 4, dtype=torch.float32)
        best = best_s(buf.sum)
        native = kernels.load()
        if native is not None:
            for ahead in (False, True):
                best = min(best, best_s(lambda ahead=ahead: native.stream_read(buf, ahead)))
        return buf.numel() * 4 / best / 1e9

    # "mem_read_gbps" (until 2026-12-06: a 512 MiB buffer, stream_read without prefetches), and
    # "mem_bw_gbps" before it (the sum alone), measured the read less well
    return float(cached("host_read_gbps", measure, fresh))


def device_limits(device: torch.device, fresh: bool = False) -> dict[str, Any]:
    """An accelerator's own limits, for the rooflines of the steps that run on it (cached per machine):

    - ``read_gbps``: its memory's read bandwidth, the faster of a sum and a copy (bytes read per second)
      of a buffer of up to 1 GiB (a quarter of the free memory at most);
    - ``link_gbps``: host-to-device copies from pinned memory (256 MiB at most), what a fetched expert crosses;
    - ``peak_gflops``: its matrix products' peak by precision (bf16 and fp16 8192^3, fp32 4096^3 on
      random data, with the process's TF32 setting; halved while three such matrices would take more
      than a quarter of the free memory).
    Each is the best of five synchronised timings after one warm-up."""
    if device.type != "cuda":
        raise ValueError(f"device_limits: {device} is not an accelerator (the host's limits are "
                         "memory_bandwidth_gbps and the kernels' dispatch report)")

    def best_s(fn) -> float:
        fn()
        torch.cuda.synchronize(device)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t)
        return best

    def memory(n: int) -> tuple[float, float]:  # (read GB/s, link GB/s) of n fp16 values
        buf = torch.ones(n, dtype=torch.float16, device=device)
        dst = torch.empty_like(buf)
        read = 2 * n / min(best_s(buf.sum), best_s(lambda: dst.copy_(buf)))
        host = torch.ones(min(n, 2**27), dtype=torch.float16).pin_memory()
        link = 2 * host.numel() / best_s(lambda: dst[: host.numel()].copy_(host, non_blocking=True))
        return read / 1e9, link / 1e9

    def peak(dtype: torch.dtype, m: int, free: int) -> float:
        size = dtype.itemsize
        while m > 1024 and 3 * m * m * size > free // 4:  # a device the engine's weights nearly fill
            m //= 2
        a = torch.randn(m, m, device=device, dtype=dtype)
        b = torch.randn(m, m, device=device, dtype=dtype)
        return 2 * m**3 / best_s(lambda: a @ b) / 1e9

    def measure() -> dict[str, Any]:
        with torch.cuda.device(device):
            free, _ = torch.cuda.mem_get_info(device)
            read, link = memory(int(min(2**30, free // 4)) // 2)
            peaks = {"bf16": peak(torch.bfloat16, 8192, free), "fp16": peak(torch.float16, 8192, free),
                     "fp32": peak(torch.float32, 4096, free)}
            torch.cuda.empty_cache()
        return {"read_gbps": read, "link_gbps": link, "peak_gflops": peaks}

    return cached(f"device_limits:{torch.cuda.get_device_name(device)}", measure, fresh)


ROUTER_TOKEN_POINTS = (1, 2, 4, 8, 16, 32)


def router_torch_tokens(n_out: int, inner: int, fresh: bool = False) -> int:
    """From how many tokens a router's fp32 product (``[tokens, inner]`` by ``[n_out, inner]``) runs faster
    on PyTorch's GEMM than on the native kernels in the fused decode step: the smallest measured count from
    which the GEMM was faster at every larger count measured, else 33 (native up to 32 tokens, the native
    MoE's own limit). Timed at 1, 2, 4, ..., 32 tokens by the kernels' ``time_router``: each product on
    weights just evicted from the caches (a step streams its experts' megabytes between two routers), called
    as the step calls it; both ways alternating, the median of 12 each; cached per machine and shape.

    Timed from Python instead, the native op's own dispatch decided it: on the AMX Xeon (64 x 1024) the
    GEMM looked faster from 1 token, while in the decode step the native product took 254-269 us a step at
    batch 1 against PyTorch's 680-735, and 539-567 against 808-886 at batch 8 (op timers)."""
    from engine import kernels

    def measure() -> int:
        native = kernels.load()
        if native is None:
            return 1  # no native kernels: PyTorch at every count
        w = torch.randn(n_out, inner)
        faster: dict[int, bool] = {}
        for t in ROUTER_TOKEN_POINTS:
            x = torch.randn(t, inner)
            times: dict[bool, list[float]] = {True: [], False: []}
            for r in range(6):
                for way in ((True, False) if r % 2 == 0 else (False, True)):
                    times[way] += native.time_router(x, w, way, 3).tolist()[1:]  # each run's first: a warm-up
            faster[t] = statistics.median(times[False]) < statistics.median(times[True])
        start = ROUTER_TOKEN_POINTS[-1] + 1
        for t in reversed(ROUTER_TOKEN_POINTS):
            if not faster[t]:
                break
            start = t
        return start

    return int(cached(f"router_torch_tokens:{n_out}x{inner}", measure, fresh))


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


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


KERNEL_SHAPE = (768, 1024)
"""[out, in] of the matrices the kernel paths are timed on (an expert's gate+up of the medium preset)."""
_KERNEL_PATHS_VERSION = 7  # of the measurement below: a change re-measures
_KERNEL_POOL = 16  # distinct matrices cycled through, each evicted from the caches before its timed call


def kernel_paths() -> dict[str, Any]:
    """Times of every product path per precision and token count on this machine (once per machine,
    software, thread count and kernel build), the table chosen from them
    (:func:`engine.kernels.choose_paths`) and each path's peak GFLOP/s."""
    from engine import kernels

    if kernels.load() is None:
        raise RuntimeError(f"kernel paths: the native kernels are unavailable ({kernels.status()['error']})")
    build = Path(str(kernels.status()["library"])).parent.name
    got = cached(f"kernel_paths:v{_KERNEL_PATHS_VERSION}:{build}", _measure_kernel_paths)
    got = {**got, "table": _path_table(got["times_s"])}  # chosen again: a cache keeps the times, not the rule
    log.info("kernel paths on this CPU: %s", got["table"])
    return got


_MOE_POINTS = (1, 2, 4, 8, 16, 32)  # tokens an expert


def moe_vector_tokens() -> int:
    """Up to how many tokens an expert a MoE layer on AMX tiles runs the expert on vdpbf16ps instead (the
    same arithmetic; :func:`engine.kernels.moe_path`), measured once per machine, software, thread count and
    kernel build: 0 where tiles are not the bf16 MoE's path or vdpbf16ps is never faster.

    Timed on the fused MoE itself, every expert at exactly n tokens, with its weights evicted from the caches
    before each call, as a decode step reads them from memory. (The path table's products were timed on a
    pool of weights a large L3 holds until kernel paths v4: on a 2-core AMX Xeon with 480 MB of L3,
    2026-12-05, they put tiles ahead of vdpbf16ps from 3 tokens, where a MoE layer from memory at 4 tokens an
    expert read 24 GB/s on vdpbf16ps and 19.6 on tiles; at 16 tokens 8.6 against 13.8.)"""
    from engine import kernels

    if kernels.load() is None or "amx" not in kernels.variants()["runnable"]:
        return 0
    if not any(str(p).endswith(":tile") for _, p in kernels.prepare()["bf16"]["native_ranges"]):  # type: ignore[union-attr]
        return 0
    build = Path(str(kernels.status()["library"])).parent.name
    got = cached(f"moe_vector_tokens:v2:{build}", _measure_moe_modes)
    log.info("MoE experts on vdpbf16ps up to %d tokens, AMX tiles above: %s", got["tokens"], got["times_s"])
    return int(got["tokens"])


def _measure_moe_modes() -> dict[str, Any]:
    from engine import kernels

    ops = kernels.ops()
    inter, hidden = KERNEL_SHAPE[0] // 2, KERNEL_SHAPE[1]
    n_exp = 16
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(n_exp, 2 * inter, hidden, generator=g) * hidden ** -0.5).bfloat16()
    w2 = (torch.randn(n_exp, hidden, inter, generator=g) * inter ** -0.5).bfloat16()
    paths = {"bf16dp": "amx:tile/999999", "tile": "amx:tile"}  # every expert on one mode
    times: dict[str, dict[str, float]] = {m: {} for m in paths}
    for n in _MOE_POINTS:
        h = torch.randn(n * n_exp, hidden, generator=g)
        ids = (torch.arange(n * n_exp) % n_exp)[:, None]  # every expert n tokens
        gates = torch.ones(n * n_exp, 1)
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(9):  # interleaved rounds, the best call: the machine may be shared (tiles prefetching
            for m, p in paths.items():  # ahead run 2-4 tokens about as fast as vdpbf16ps: 5 rounds chose 1-4)
                ops.evict(w13)
                ops.evict(w2)
                t = time.perf_counter()
                ops.moe(h, w13, w2, ids, gates, p)
                best[m] = min(best[m], time.perf_counter() - t)
        for m, v in best.items():
            times[m][str(n)] = v
    tokens = 0
    for n in _MOE_POINTS:  # the vector mode up to the first count where tiles are faster
        if times["bf16dp"][str(n)] >= times["tile"][str(n)]:
            break
        tokens = n
    return {"shape": [n_exp, hidden, inter], "times_s": times, "tokens": tokens}


def _path_table(times: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, object]]:
    """:func:`engine.kernels.choose_paths` over the candidates among ``times`` (which also holds paths timed
    for the compute roofline only)."""
    from engine import kernels

    runnable, amx = kernels.variants()["runnable"], kernels.amx_present()
    return kernels.choose_paths({prec: {p: ts for p, ts in by.items() if p in kernels.candidate_paths(prec, runnable, amx)}
                                 for prec, by in times.items() if prec in kernels.PRECISIONS}, modes=kernels.modes())


def _measure_kernel_paths() -> dict[str, Any]:
    from engine import kernels
    from engine.moe import quant

    ops = kernels.ops()
    n, k = KERNEL_SHAPE
    group = 128
    runnable = kernels.variants()["runnable"]
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(n, k, generator=g) * k ** -0.5 for _ in range(_KERNEL_POOL)]
    half = {"bf16": [w.bfloat16() for w in base], "fp16": [w.half() for w in base]}
    full = base[:4]  # fp32 weights (PyTorch's own fp32 GEMM: the engine without its kernels)
    int8 = [quant.quantize(w, "int8") for w in base]
    int4_native = [quant.quantize(w, "int4", group, native=True) for w in base]
    int4_torch = [quant.quantize(w, "int4", group) for w in base]

    def evict(prec: str, p: str, i: int) -> None:
        """Pool matrix i of the path's precision out of the caches: decode reads its weights from memory (a
        pool that a large L3 holds ranked the paths as read from cache: on the AMX Xeon, 2026-12-05, tiles
        with prefetches ahead took bf16 at one token from vdpbf16ps, and a batch-1 decode step went from
        19.9 to 21.9 ms)."""
        if prec in half:
            ops.evict(half[prec][i])
        elif prec == "fp32":
            ops.evict(full[i % len(full)])
        else:
            q = (int8 if prec == "int8" else int4_torch if p == "torch:quant" else int4_native)[i]
            for t in (q.data, q.scales):
                if t is not None and t.is_contiguous():
                    ops.evict(t)

    def runner(prec: str, p: str):
        if prec in half:
            ws = half[prec]
            if p == "torch:widen":
                return lambda x, xb, i: F.linear(x, ws[i].float())
            if p == "torch:bf16":
                return lambda x, xb, i: F.linear(xb, ws[i]).float()
            return lambda x, xb, i: ops.linear_q(x, ws[i], None, 0, 0, p, None)
        qs = int8 if prec == "int8" else (int4_torch if p == "torch:quant" else int4_native)
        if p == "torch:quant":
            return lambda x, xb, i: quant.qlinear(x, qs[i], "kernel")
        return lambda x, xb, i: ops.linear_q(x, qs[i].data, qs[i].scales, qs[i].group_size or 0, n, p, None)

    amx = kernels.amx_present()
    cands = {prec: {p: runner(prec, p) for p in kernels.candidate_paths(prec, runnable, amx)}
             for prec in kernels.PRECISIONS}
    # Timed for the compute roofline only (not candidates): PyTorch's fp32 GEMM, and its bf16 products
    # where they are not already a candidate (without AMX).
    cands["fp32"] = {"torch:fp32": lambda x, xb, i: F.linear(x, full[i % len(full)])}
    if "torch:bf16" not in cands["bf16"]:
        cands["bf16"]["torch:bf16"] = runner("bf16", "torch:bf16")
    times: dict[str, dict[str, dict[str, float]]] = {prec: {p: {} for p in ps} for prec, ps in cands.items()}
    t0 = time.perf_counter()
    for n_tok in kernels.TOKEN_POINTS:
        x = torch.randn(n_tok, k, generator=g)
        xb = x.bfloat16()
        reps = max(2, 64 // n_tok)
        best = {(prec, p): float("inf") for prec, ps in cands.items() for p in ps}
        for ps in cands.values():
            for f in ps.values():
                f(x, xb, 0)  # warm-up (and the first call's allocations)
        # Interleaved rounds; each round's median call, the best round: the machine may be shared. (The best
        # single call picked lucky ones: on the AMX Xeon, 2026-12-05, tiles at one token came out ahead of
        # vdpbf16ps in one build in three, where from memory they are 10-19 % slower: /tmp script, medians of
        # 200-300 matrices, us, 1536 x 1024 135 against 150, 1024 x 1024 88 against 105, 32000 x 1024 2100
        # against 2300.)
        for _ in range(5 if n_tok <= 256 else 3):  # the long products take most of the time: fewer rounds
            for prec, ps in cands.items():
                for p, f in ps.items():
                    calls = []
                    for i in range(reps):
                        evict(prec, p, i % _KERNEL_POOL)
                        t = time.perf_counter()
                        f(x, xb, i % _KERNEL_POOL)
                        calls.append(time.perf_counter() - t)
                    best[(prec, p)] = min(best[(prec, p)], statistics.median(calls))
        for (prec, p), v in best.items():
            times[prec][p][str(n_tok)] = v
    flop = {str(t): 2.0 * t * n * k for t in kernels.TOKEN_POINTS}
    peaks = {prec: {p: max(flop[t] / v for t, v in ts.items()) / 1e9 for p, ts in by.items()}
             for prec, by in times.items()}
    log.info("measured the kernel paths in %.1f s", time.perf_counter() - t0)
    return {"shape": [n, k], "group_size": group, "points": list(kernels.TOKEN_POINTS), "threads": torch.get_num_threads(),
            "times_s": times, "peak_gflops": peaks, "table": _path_table(times)}
