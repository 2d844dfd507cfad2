"""``engine doctor``: what this machine gives the engine, and what is broken.

One report of every path the engine can take here and the one it will take: the CPU's ISA, moetune's
native kernels (built, ISA, library, or the compiler's first error), the compute dtype ``auto``
picks and the measurement behind it, PyTorch's packed int8/int4 kernels, CUDA devices, NVML, green
contexts, versions and the cache directory. ``problems`` lists what must be fixed (the command
exits 1 when there is any); ``notes`` what is merely absent.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Any

import torch

from engine.env import cache_dir, db_url, huge_pages, omp_wait_policy
from engine.hwinfo import ISA_FLAGS, cpu_flags, hardware

# The expert shape the compute-dtype measurement uses when no model is given: the medium preset's
# (hidden 1024, expert width 384), a decode-sized product that the engine's choice hinges on.
REFERENCE_HIDDEN, REFERENCE_INTER = 1024, 384


def _cpu() -> dict[str, Any]:
    flags = cpu_flags()
    hw = hardware()
    return {"model": hw["cpu_model"], "cores": hw["cpu_cores"], "torch_threads": torch.get_num_threads(),
            "isa": {f: f in flags for f in ISA_FLAGS},
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn": torch.backends.mkldnn.is_available(),
            "amx": bool(torch.cpu._is_amx_tile_supported()) if hasattr(torch.cpu, "_is_amx_tile_supported") else False}


def _compiler_version(path: str | None) -> str | None:
    if not path:
        return None
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False).stdout
    return out.splitlines()[0] if out else None


def _kernels() -> dict[str, Any]:
    from engine import kernels

    t = time.perf_counter()
    st = kernels.status()  # builds on first use: the time says whether it was cached
    out = {**st, "compiler_version": _compiler_version(st["compiler"]), "load_s": round(time.perf_counter() - t, 3)}
    # The chosen path per precision and token-count range (measured once per machine, then cached).
    out["dispatch"] = kernels.dispatch_report() if st["available"] else None
    out["dispatch_summary"] = kernels.dispatch_summary() if st["available"] else None
    return out


def _compute_dtype(hidden: int, inter: int) -> dict[str, Any]:
    """What ``compute_dtype=auto`` picks on this CPU for half-precision checkpoints (with the default
    ``cpu_kernels=auto``), and what PyTorch alone would pick (``cpu_kernels=torch``) with its timings."""
    from engine.calibrate import compute_dtype_measurement, cpu_compute_dtype

    out: dict[str, Any] = {"shape": f"{hidden}x{2 * inter}"}
    for stored in (torch.bfloat16, torch.float16):
        m = compute_dtype_measurement(stored, hidden, inter)
        out[str(stored).replace("torch.", "")] = {
            "auto_picks": str(cpu_compute_dtype(stored, hidden, inter, "auto")).replace("torch.", ""),
            "torch_only_picks": m["pick"].replace("torch.", ""), "times_s": m["times_s"]}
    return out


def _quant() -> dict[str, Any]:
    from engine.moe import quant

    return {"kernels": quant.kernel_report(), "int4_cpu_block_rows": quant._cpu_block_rows()}


def _cuda() -> dict[str, Any]:
    info: dict[str, Any] = {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
                            "devices": []}
    if info["available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["devices"].append({"index": i, "name": p.name, "mem_total_bytes": p.total_memory,
                                    "capability": f"{p.major}.{p.minor}", "sm_count": p.multi_processor_count})
    try:
        from torch.cuda.green_contexts import SUPPORTED
    except ImportError:
        SUPPORTED = False
    info["green_contexts"] = bool(SUPPORTED)
    return info


def _nvml() -> dict[str, Any]:
    try:
        import pynvml  # from nvidia-ml-py
    except ImportError as e:
        return {"available": False, "error": f"nvidia-ml-py is not installed ({e})"}
    try:
        pynvml.nvmlInit()
    except Exception as e:  # no driver or library: NVMLError_LibraryNotFound and friends
        return {"available": False, "error": f"{type(e).__name__}: {e}"}
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            devices.append({"index": i, "name": pynvml.nvmlDeviceGetName(h), "mem_used_bytes": int(mem.used),
                            "mem_total_bytes": int(mem.total)})
        return {"available": True, "driver": driver if isinstance(driver, str) else driver.decode(),
                "devices": devices}
    finally:
        pynvml.nvmlShutdown()


def _cache() -> dict[str, Any]:
    root = cache_dir()
    probe = root if root.exists() else next((p for p in root.parents if p.exists()), root)
    return {"dir": str(root), "exists": root.exists(), "writable": os.access(probe, os.W_OK),
            "MOETUNE_CACHE": os.environ.get("MOETUNE_CACHE"), "MOETUNE_DB": db_url()}


def diagnose(hidden: int = REFERENCE_HIDDEN, inter: int = REFERENCE_INTER) -> dict[str, Any]:
    """The whole report; ``problems`` is empty when nothing the engine needs is broken."""
    report: dict[str, Any] = {
        "python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
        "cpu": _cpu(), "kernels": _kernels(), "quant": _quant(), "cuda": _cuda(), "nvml": _nvml(),
        "cache": _cache(), "omp_wait_policy": omp_wait_policy(), "huge_pages": huge_pages(),
    }
    report["compute_dtype"] = _compute_dtype(hidden, inter)
    problems, notes = [], []
    k = report["kernels"]
    if k["state"] == "broken":
        problems.append(f"native CPU kernels: {k['compiler']} is there but the build or load fails: {k['error']}")
    elif k["state"] == "missing":
        notes.append("native CPU kernels: no C++ compiler (install g++); the engine widens weights to fp32")
    cuda, nvml = report["cuda"], report["nvml"]
    if cuda["available"] and not nvml["available"]:
        problems.append(f"CUDA devices but no NVML ({nvml['error']}): GPU telemetry would be missing")
    if not cuda["available"] and shutil.which("nvidia-smi"):
        problems.append("nvidia-smi is present but PyTorch sees no CUDA device (a CPU-only torch build?)")
    if cuda["available"] and not cuda["green_contexts"]:
        notes.append("no CUDA green contexts in this PyTorch: execution.expert_sm_share is inert")
    for dev, precisions in report["quant"]["kernels"].items():
        for p, kernel in precisions.items():
            if kernel == "dequant":
                notes.append(f"{p} weights on {dev}: no packed PyTorch kernel here; dequantise-then-GEMM")
    if not report["cache"]["writable"]:
        problems.append(f"cache directory {report['cache']['dir']} is not writable (set MOETUNE_CACHE)")
    report["problems"], report["notes"] = problems, notes
    return report


def _dispatch_lines(d: dict[str, Any] | None) -> list[str]:
    """The chosen path per precision and token-count range, the measured peaks, AMX."""
    if not d or not d.get("available"):
        return []
    lines = [f"          variants compiled {' '.join(d['compiled'])}; runnable here {' '.join(d['runnable'])}",
             f"          AMX {d['amx']['detail']}"]
    shape = d.get("measured_shape")
    lines.append("paths     (measured" + (f" on a {shape[0]}x{shape[1]} product" if shape else "")
                 + f" at {', '.join(map(str, d.get('token_points') or []))} tokens)")
    for prec, t in d["paths"].items():
        lo, parts = 1, []
        for upper, p in t["ranges"]:
            parts.append(f"{lo}-{upper} tokens {p}" if upper is not None else f"{lo}+ tokens {p}")
            lo = (upper or 0) + 1
        forced = d["forced"].get(prec)
        peaks = d["peak_gflops"].get(prec, {})
        lines.append(f"          {prec:<5} " + (f"{forced} (forced)" if forced else "; ".join(parts))
                     + (" | peak " + ", ".join(f"{p} {g:.0f} GFLOP/s" for p, g in peaks.items()) if peaks else ""))
    att = d.get("attention") or {}
    if att:
        lines.append("attention decode on the " + (f"{att['decode']} kernel" if att["decode"] else "scalar loop")
                     + "; prompts " + (f"on the {att['prompts']} kernel (blocks of 16 tokens)" if att["prompts"]
                                       else "token by token as decode")
                     + " (head sizes a multiple of 8; others: the scalar loop)")
    return lines


def format_report(r: dict[str, Any]) -> str:
    """The readable part of ``engine doctor``."""
    cpu, k, cd = r["cpu"], r["kernels"], r["compute_dtype"]
    has = [f for f, on in cpu["isa"].items() if on]
    lines = [
        f"python {r['python']}, torch {r['torch']}, {r['platform']}",
        f"cpu       {cpu['model']}: {cpu['cores']} cores, torch threads {cpu['torch_threads']}, "
        f"PyTorch capability {cpu['torch_cpu_capability']}, AMX {'yes' if cpu['amx'] else 'no'}",
        f"          ISA: {' '.join(has) or 'none of ' + ' '.join(cpu['isa'])}",
        f"kernels   {k['state']}" + (f": {k['isa']} from {k['library']} ({k['load_s']:.1f} s)" if k["available"]
                                     else f": {k['error']}"),
        f"          compiler {k['compiler'] or 'none'}" + (f" ({k['compiler_version']})" if k["compiler_version"] else ""),
        f"threads   OpenMP waits {r['omp_wait_policy']}",
        f"memory    huge pages {r['huge_pages']}",
    ]
    lines += _dispatch_lines(k.get("dispatch"))
    for name in ("bfloat16", "float16"):
        d = cd[name]
        times = d["times_s"]
        detail = ", ".join(f"{m}: " + " vs ".join(f"{dt.replace('torch.', '')} {t * 1e6:.0f} us" for dt, t in v.items())
                           for m, v in times.items())
        if d["auto_picks"] == "float32" and k["available"]:
            lines.append(f"compute   {name} checkpoints: auto computes in float32, weights read as stored by the "
                         f"native kernels (paths above); with cpu_kernels=torch, in {d['torch_only_picks']} "
                         f"({cd['shape']} product; {detail})")
            continue
        weights = "widened to float32" if d["auto_picks"] == "float32" else "as stored"
        lines.append(f"compute   {name} checkpoints: auto computes in {d['auto_picks']}, weights {weights} "
                     f"({cd['shape']} product; {detail})")
    for dev, precisions in r["quant"]["kernels"].items():
        lines.append(f"quant     {dev}: " + ", ".join(f"{p} {kern}" for p, kern in precisions.items()))
    cuda = r["cuda"]
    if cuda["available"]:
        for d in cuda["devices"]:
            lines.append(f"cuda      {d['index']}: {d['name']}, {d['mem_total_bytes'] / 2**30:.1f} GiB, "
                         f"sm_{d['capability'].replace('.', '')}, {d['sm_count']} SMs")
        lines.append(f"          green contexts: {'yes' if cuda['green_contexts'] else 'no'}")
    else:
        lines.append(f"cuda      none (torch built with CUDA {cuda['torch_cuda'] or 'no'})")
    nvml = r["nvml"]
    lines.append("nvml      " + (f"driver {nvml['driver']}, {len(nvml['devices'])} devices" if nvml["available"]
                                 else f"unavailable ({nvml['error']})"))
    c = r["cache"]
    lines.append(f"cache     {c['dir']} ({'exists' if c['exists'] else 'not yet made'}, "
                 f"{'writable' if c['writable'] else 'NOT writable'})")
    lines += [f"PROBLEM   {p}" for p in r["problems"]] + [f"note      {n}" for n in r["notes"]]
    lines.append("ok: nothing the engine needs is broken" if not r["problems"] else
                 f"{len(r['problems'])} problem(s)")
    return "\n".join(lines)
