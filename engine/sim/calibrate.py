"""``engine calibrate``: measure this machine into a simulator profile (:mod:`engine.sim.profile`).

Three stages, each timed with the engine's own kernels (mechanism, so torch is imported here):

1. the host's limits: DRAM read bandwidth, the fp32 GEMM rate, which compute precision the engine
   picks for half-precision weights, thread scaling of an expert product;
2. operation tables at a calibration shape (hidden :data:`CAL_HIDDEN`, expert width
   :data:`CAL_INTER`): one expert's SwiGLU on the per-expert path per weight precision (fp32, bf16,
   int8, int4) against tokens, one expert inside the fused layer call and the call's own fixed work,
   dense products per precision, building an int8/int4 copy. The pricer scales the tables to other
   shapes by weight elements;
3. the engine's fixed costs, fitted end to end: a live run of a small model (``cal_model``) is
   re-priced by the simulator with the tables of stage 2 and no overheads on the very same steps
   (same routing, same plans); the per-step residual, regressed on tokens per step, gives
   ``layer_overhead_s`` (the intercept spread over decoder layers) and ``token_overhead_s``; a second
   live run with the hybrid executor (static residency, host experts) gives ``moe_layer_overhead_s``.

With CUDA the device side (expert products per precision, host <-> device bandwidth pinned and
pageable per direction, SM-share scaling) is measured by :func:`_measure_cuda`; this session's
machines have no GPU, so that path has not run (the README says GPU profiles are unvalidated).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from engine.sim.profile import PROFILE_FORMAT, PROFILE_VERSION, Profile

log = logging.getLogger(__name__)

CAL_HIDDEN = 1024
CAL_INTER = 768
TOKEN_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CAL_MODEL = "builtin:qwen3_moe-small"
Progress = Callable[[str], None]


def _time(fn: Callable[[], Any], reps: int, sync: Callable[[], None] | None = None) -> float:
    """Fastest seconds of ``fn`` over ``reps`` runs after one warm-up: the operation's own cost; what a
    loaded machine adds (other processes taking the cores) lands in the end-to-end fit of stage 3."""
    fn()
    if sync:
        sync()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        if sync:
            sync()
        out.append(time.perf_counter() - t)
    return min(out)


def _reps(n_tokens: int) -> int:
    return 15 if n_tokens <= 32 else 7


def _host_limits(progress: Progress) -> dict[str, Any]:
    import torch

    from engine.calibrate import cpu_compute_dtype, memory_bandwidth_gbps

    progress("host: memory bandwidth")
    bw = memory_bandwidth_gbps() * 1e9
    progress("host: fp32 GEMM rate")
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    fp32 = 2 * 512 * 1024 * 1024 / _time(lambda: a @ b, 7)
    a16, b16 = a.bfloat16(), b.bfloat16()
    bf16 = 2 * 512 * 1024 * 1024 / _time(lambda: a16 @ b16, 5)
    progress("host: compute precision for bf16 weights")
    auto = str(cpu_compute_dtype(torch.bfloat16, CAL_HIDDEN, CAL_INTER, "auto")).replace("torch.", "")
    return {"mem_bw_bytes_per_s": bw, "peak_flops": {"fp32": fp32, "bf16": bf16}, "auto_compute_dtype": auto}


def _expert_tables(progress: Progress) -> tuple[dict[str, Any], dict[str, float]]:
    """Per-expert, fused and dense tables on the host, and thread scaling."""
    import torch

    from engine import kernels
    from engine.moe import quant
    from engine.moe.experts import fused_moe, make_version, swiglu

    h, i = CAL_HIDDEN, CAL_INTER
    torch.manual_seed(0)
    w13, w2 = torch.randn(2 * i, h) * 0.02, torch.randn(h, i) * 0.02
    cpu = torch.device("cpu")
    shape = {"hidden": h, "inter": i}
    tables: dict[str, Any] = {}
    versions = {}
    for prec in ("fp32", "bf16", "int8", "int4"):
        progress(f"host: expert products, {prec} weights")
        v = make_version(w13, w2, prec, cpu, 128)
        versions[prec] = v
        secs = []
        for n in TOKEN_GRID:
            x = torch.randn(n, h)
            secs.append(_time(lambda v=v, x=x: swiglu(v, x, True), _reps(n)))
        tables[f"expert:{prec}@fp32"] = {"x": list(TOKEN_GRID), "seconds": secs, "shape": shape}
        if prec in ("int8", "int4"):
            tables[f"quantize:{prec}"] = {"x": [1], "seconds": [_time(lambda p=prec: make_version(w13, w2, p, cpu, 128),
                                                                      3)], "shape": shape}
    progress("host: fused layer call")
    try:
        kernels.ops()
        native = True
    except Exception as e:  # noqa: BLE001 - recorded: the profile then says the host has no native kernels
        log.warning("native kernels unavailable (%s): the profile prices the torch paths", e)
        native = False
    if native:
        for prec, cdt in (("bf16", torch.float32), ("int8", torch.float32)):  # the native kernels take fp32
            comp = "fp32" if cdt == torch.float32 else "bf16"
            n_exp = 8
            one = {0: versions[prec]}
            many = {e: versions[prec] for e in range(n_exp)}
            ef, call = [], []
            grid = [n for n in TOKEN_GRID if n <= 32]
            for n in grid:
                x = torch.randn(n, h, dtype=cdt)
                ids1 = torch.zeros(n, 1, dtype=torch.int64)
                idsk = torch.arange(n_exp).repeat(n, 1)
                g1, gk = torch.ones(n, 1), torch.ones(n, n_exp) / n_exp
                t1 = _time(lambda x=x, ids=ids1, g=g1, vs=one, e=n_exp: fused_moe(x, g, ids, vs, e), _reps(n))
                tk = _time(lambda x=x, ids=idsk, g=gk, vs=many, e=n_exp: fused_moe(x, g, ids, vs, e), _reps(n))
                e_s = max((tk - t1) / (n_exp - 1), t1 * 0.05)
                ef.append(e_s)
                call.append(max(t1 - e_s, 1e-7))
            tables[f"expert_fused:{prec}@{comp}"] = {"x": grid, "seconds": ef, "shape": shape}
            if prec == "bf16":
                tables[f"moe_fused_call@{comp}"] = {"x": grid, "seconds": call, "shape": {"hidden": h}}
    progress("host: dense products")
    for prec in ("fp32", "bf16"):
        w = w13[:h].contiguous().to(torch.float32 if prec == "fp32" else torch.bfloat16)
        secs = []
        for n in TOKEN_GRID:
            x = torch.randn(n, h)
            secs.append(_time(lambda x=x, w=w: kernels.linear(x, w), _reps(n)))
        tables[f"matmul:{prec}@fp32"] = {"x": list(TOKEN_GRID), "seconds": secs, "shape": {"n": h, "k": h}}
    # runtime.dense_precision=int8: int8 copies with row scales on the native int8 path
    qw = quant.quantize(w13[:h].contiguous(), "int8")
    secs = []
    for n in TOKEN_GRID:
        x = torch.randn(n, h)
        secs.append(_time(lambda x=x: kernels.linear_int8(x, qw.data, qw.scales), _reps(n)))
    tables["matmul:int8@fp32"] = {"x": list(TOKEN_GRID), "seconds": secs, "shape": {"n": h, "k": h}}
    # compute_dtype=checkpoint on a bf16 checkpoint: bf16 activations, whose products take other paths
    # (5-10x slower than fp32 from 64 tokens on a CPU without AMX; a roofline from one bf16 GEMM misses
    # by as much either way).
    progress("host: expert and dense products at bf16 compute")
    for prec in ("bf16", "int8", "int4"):
        secs = []
        for n in TOKEN_GRID:
            x = torch.randn(n, h, dtype=torch.bfloat16)
            secs.append(_time(lambda v=versions[prec], x=x: swiglu(v, x, True), 3 if n >= 64 else _reps(n)))
        tables[f"expert:{prec}@bf16"] = {"x": list(TOKEN_GRID), "seconds": secs, "shape": shape}
    w = w13[:h].contiguous().to(torch.bfloat16)
    secs = []
    for n in TOKEN_GRID:
        x = torch.randn(n, h, dtype=torch.bfloat16)
        secs.append(_time(lambda x=x, w=w: kernels.linear(x, w), 3 if n >= 64 else _reps(n)))
    tables["matmul:bf16@bf16"] = {"x": list(TOKEN_GRID), "seconds": secs, "shape": {"n": h, "k": h}}
    progress("host: expert products with torch kernels (cpu_kernels=torch)")
    for prec in ("bf16", "int8", "int4"):
        secs = []
        for n in TOKEN_GRID:
            x = torch.randn(n, h)
            secs.append(_time(lambda v=versions[prec], x=x: swiglu(v, x, False), 3 if n >= 64 else _reps(n)))
        tables[f"expert_torch:{prec}@fp32"] = {"x": list(TOKEN_GRID), "seconds": secs, "shape": shape}
    progress("host: thread scaling")
    threads = torch.get_num_threads()
    scaling: dict[str, float] = {}
    x = torch.randn(32, h)
    base = _time(lambda: swiglu(versions["bf16"], x, True), 7)
    for n in sorted({1, max(1, threads // 2), threads}):
        torch.set_num_threads(n)
        try:
            scaling[f"{n}"] = base / _time(lambda: swiglu(versions["bf16"], x, True), 7)
        finally:
            torch.set_num_threads(threads)
    extra = {"native": native, "threads": threads}
    return {"tables": tables, "thread_scaling": scaling}, extra


def _profile(host: dict[str, Any], measured: dict[str, Any], name: str, device: dict[str, Any] | None = None,
             link: dict[str, Any] | None = None) -> Profile:
    return Profile.parse({"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": name, "calibrated": True,
                          "source": "engine calibrate", "host": host, "device": device, "link": link,
                          "measured": measured}, "calibration")


def _fit_overheads(host: dict[str, Any], measured: dict[str, Any], name: str, model: str, progress: Progress,
                   device: dict[str, Any] | None = None, link: dict[str, Any] | None = None) -> dict[str, Any]:
    """Step, token and per-layer overheads from live runs re-priced step by step (module docstring),
    fitted into the fast tier's processor (the device where there is one, else the host); returns it."""
    from engine.backend import make_backend
    from engine.backend_sim import SimBackend
    from engine.config import EngineConfig
    from engine.model.arch import read_config
    from engine.model.maker import resolve_model
    from engine.runner import run_workload
    from engine.sim.step import FUSED_PRECISIONS  # noqa: F401 - the pricer's paths are the fit's
    from workloads.router import RouterTrace
    from workloads.synth import synth_workload

    _, spec = read_config(resolve_model(model))
    wl = synth_workload("calibrate", 16, arrival="poisson", rate_per_s=1000.0, prompt_len="uniform:8:96",
                        output_len="uniform:4:40", seed=11)

    def residuals(cfg: EngineConfig, prof: Profile) -> tuple[np.ndarray, np.ndarray]:
        live = make_backend(model, cfg)
        got = run_workload(live, wl, mode="offline", record_routes=True)
        routes = got.meta["routes"]
        keys = list(routes)
        trace = RouterTrace.from_arrays(request_ids=keys, expert_ids=[routes[k][0] for k in keys],
                                        gate_weights=[routes[k][1] for k in keys],
                                        model_identity=live.model_identity())
        sim = SimBackend.from_model(model, cfg, profile=prof, trace=trace)
        priced = run_workload(sim, wl, mode="offline")
        a = np.array([s.duration_ms for s in got.steps[1:]]) / 1e3  # the first step pays warm-up costs
        b = np.array([s.duration_ms for s in priced.steps[1:]]) / 1e3
        tok = np.array([s.prefill_tokens + s.decode_tokens for s in got.steps[1:]], np.float64)
        return a - b, tok, a

    def profile(fast: dict[str, Any]) -> Profile:
        return _profile(host, measured, name, fast, link) if device is not None else \
            _profile(fast, measured, name)

    fast = dict(device if device is not None else host)
    progress(f"fit: overheads, plain config on {model}")
    base = EngineConfig()
    r, tok, live_s = residuals(base, profile(fast))
    intercept, slope = fit_relative(tok, r, live_s)
    fast.update(step_overhead_s=0.0, layer_overhead_s=intercept / spec.n_layers, token_overhead_s=slope)
    progress("fit: overheads, hybrid executor (static residency, host experts)")
    budget_gib = 0.5 * spec.expert_params() * 2 * spec.n_experts * len(spec.moe_layers) / 2**30
    hybrid = base.replace(residency="static", resident_budget_gib=budget_gib, missing_expert="host")
    r2, _, _ = residuals(hybrid, profile(fast))
    fast["moe_layer_overhead_s"] = max(float(np.median(r2)), 0.0) / max(len(spec.moe_layers), 1)
    measured["fit"] = {"model": model, "fitted": "device" if device is not None else "host", "steps": int(len(r)),
                       "residual_plain_median_s": float(np.median(r)), "residual_hybrid_median_s": float(np.median(r2))}
    return fast


def fit_relative(tokens: np.ndarray, residual_s: np.ndarray, live_s: np.ndarray) -> tuple[float, float]:
    """``residual = a + b x tokens`` with a, b >= 0, minimising the error relative to each step's live
    time (a least-squares fit in seconds would be decided by the few long prefill steps alone, and
    the fixed cost per step is what decode steps of one token pay)."""
    w = 1.0 / np.maximum(live_s, 1e-6)
    design = np.stack([np.ones_like(tokens), tokens], axis=1) * w[:, None]
    target = residual_s * w
    (a, b), *_ = np.linalg.lstsq(design, target, rcond=None)
    if a < 0:  # no fixed part: the token term alone
        a, b = 0.0, max(float((design[:, 1] @ target) / (design[:, 1] @ design[:, 1])), 0.0)
    if b < 0:
        b, a = 0.0, max(float(np.sum(target * w) / np.sum(w * w)), 0.0)
    return float(a), float(b)


def calibrate(progress: Progress | None = None, model: str = CAL_MODEL, name: str | None = None) -> Profile:
    """Measure this machine (see the module docstring) and return its calibrated profile."""
    import platform

    import torch

    from engine.hwinfo import hardware

    say = progress or (lambda _msg: None)
    t0 = time.perf_counter()
    hw = hardware()
    limits = _host_limits(say)
    tabs, extra = _expert_tables(say)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    host: dict[str, Any] = {
        "name": hw["cpu_model"], "mem_bytes": float(hw["mem_total_bytes"]),
        "mem_bw_bytes_per_s": limits["mem_bw_bytes_per_s"], "peak_flops": limits["peak_flops"],
        "bw_efficiency": 1.0, "compute_efficiency": 1.0,  # measured rates: nothing to discount
        "cores": cores, "threads": extra["threads"], "thread_scaling": tabs["thread_scaling"],
        "tables": tabs["tables"],
        "native_max_tokens": 32 if extra["native"] else 0,
        "fused_max_tokens_per_expert": 32 if extra["native"] else 0,
    }
    measured: dict[str, Any] = {"hardware_fingerprint": hw["fingerprint"], "cpu": hw["cpu_model"],
                                "torch": torch.__version__, "python": platform.python_version(),
                                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                "auto_compute_dtype": limits["auto_compute_dtype"],
                                "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    label = name or f"calibrated-{hw['fingerprint']}"
    device = link = None
    if torch.cuda.is_available():
        device, link = _measure_cuda(say)
        measured["gpu"] = torch.cuda.get_device_name(0)
    fitted = _fit_overheads(host, measured, label, model, say, device, link)
    if device is not None:
        device = fitted
    else:
        host = fitted
    measured["seconds"] = round(time.perf_counter() - t0, 1)
    data = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": label, "calibrated": True,
            "source": "engine calibrate", "host": host, "device": device, "link": link, "measured": measured}
    return Profile.parse(data, "calibration")


def _measure_cuda(progress: Progress) -> tuple[dict[str, Any], dict[str, Any]]:
    """The device's expert tables, memory and SM count, and the host <-> device link (CUDA only)."""
    import torch

    from engine.calibrate import device_limits
    from engine.moe.experts import make_version, swiglu

    dev = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(dev)
    sync = torch.cuda.synchronize
    h, i = CAL_HIDDEN, CAL_INTER
    w13, w2 = torch.randn(2 * i, h) * 0.02, torch.randn(h, i) * 0.02
    tables: dict[str, Any] = {}
    shape = {"hidden": h, "inter": i}
    for prec in ("bf16", "int8", "int4"):
        progress(f"device: expert products, {prec} weights")
        v = make_version(w13, w2, prec, dev, 128)
        secs = []
        for n in TOKEN_GRID:
            x = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
            secs.append(_time(lambda v=v, x=x: swiglu(v, x, False), 20, sync))
        tables[f"expert:{prec}@bf16"] = {"x": list(TOKEN_GRID), "seconds": secs, "shape": shape}
    progress("device: dense products and memory bandwidth")
    w = torch.randn(h, h, device=dev, dtype=torch.bfloat16)
    secs = []
    for n in TOKEN_GRID:
        x = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
        secs.append(_time(lambda x=x: x @ w.T, 20, sync))
    tables["matmul:bf16@bf16"] = {"x": list(TOKEN_GRID), "seconds": secs, "shape": {"n": h, "k": h}}
    # The device's read bandwidth, bf16 peak and pinned host-to-device link: the rooflines' own measures.
    limits = device_limits(dev)
    bw, bf16 = limits["read_gbps"] * 1e9, limits["peak_gflops"]["bf16"] * 1e9
    progress("link: host <-> device bandwidth, pinned and pageable")
    nbytes = 64 * 2**20
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    on_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    link = {"h2d_pinned_bytes_per_s": limits["link_gbps"] * 1e9,
            "h2d_pageable_bytes_per_s": nbytes / _time(lambda: on_dev.copy_(pageable), 5, sync),
            "d2h_pinned_bytes_per_s": nbytes / _time(lambda: pinned.copy_(on_dev, non_blocking=True), 5, sync),
            "d2h_pageable_bytes_per_s": nbytes / _time(lambda: pageable.copy_(on_dev), 5, sync),
            "latency_s": _time(lambda: on_dev[:64].copy_(pinned[:64], non_blocking=True), 20, sync),
            "copy_engines": 2, "overlap": 1.0}
    device = {"name": props.name, "mem_bytes": float(props.total_memory), "mem_bw_bytes_per_s": bw,
              "peak_flops": {"bf16": bf16, "fp16": bf16, "int8": bf16}, "bw_efficiency": 1.0,
              "compute_efficiency": 1.0, "sm_count": props.multi_processor_count, "tables": tables,
              "step_overhead_s": 1e-3, "layer_overhead_s": 40e-6, "call_overhead_s": 5e-6}
    return device, link
