"""What machine and software a result came from (recorded with every run)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from functools import lru_cache
from importlib import metadata
from typing import Any

import psutil

from engine.env import huge_pages, omp_wait_policy


def _torch() -> Any:
    """torch, or None in a process without it (a backend without tensors runs there)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: The CPU features that decide the engine's paths (kernels, compute dtype), as /proc/cpuinfo names them.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@lru_cache(maxsize=1)
def hardware() -> dict[str, Any]:
    """CPU, memory and accelerator of this machine; ``fingerprint`` is a short hash of them."""
    flags = cpu_flags()
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "mem_total_bytes": psutil.virtual_memory().total,
        "cpu_features": sorted(f for f in flags if f in ISA_FLAGS or f.startswith("amx")),
        "gpu": None,
    }
    torch = _torch()
    if torch is not None and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": p.name, "count": torch.cuda.device_count(), "mem_total_bytes": p.total_memory,
                       "sm_count": p.multi_processor_count}
    blob = json.dumps({k: info[k] for k in ("cpu_model", "cpu_cores", "gpu")}, sort_keys=True, default=str)
    info["fingerprint"] = hashlib.sha256(blob.encode()).hexdigest()[:12]
    return info


def software() -> dict[str, str]:
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "absent"

    torch = _torch()
    if torch is None:  # a backend without tensors, in a process without torch
        return {"python": sys.version.split()[0], "torch": "absent", "moetune": version("moetune"), "cuda": "none",
                "platform": platform.platform(), "kernels": None}
    return {"python": sys.version.split()[0], "torch": torch.__version__, "moetune": version("moetune"),
            "cuda": torch.version.cuda or "none", "platform": platform.platform(), "kernels": kernel_state(),
            "omp_wait_policy": omp_wait_policy(), "huge_pages": huge_pages()}


def kernel_state() -> dict[str, Any]:
    """Which native paths this process has: moetune's CPU kernels (state, ISA, error) and PyTorch's packed
    int8/int4 kernels per device type; recorded in every result so it says which path produced it."""
    from engine import kernels
    from engine.moe import quant

    st = kernels.status()
    return {"cpu_kernels": st["state"], "isa": st["isa"], "error": st["error"], "quant": quant.kernel_report()}
