"""moetune's native CPU kernels: fp32 products that read bf16/fp16 weights as stored.

``cpu_kernels.cpp`` is compiled on first use with the system C++ compiler (``$CXX``, else ``c++``)
against the installed PyTorch, for this CPU (``-march=native``), and kept in the cache directory
under a key of the source, PyTorch, compiler and CPU flags; later processes load it in milliseconds.
Where they cannot be had, :func:`load` returns None with the reason in :func:`status`, which tells
the two cases apart: no C++ compiler at all (``missing``: the engine may widen weights to fp32 and use
PyTorch's products, and says so in every result) and a compiler whose build or load fails (``broken``:
a bug, which the engine refuses to paper over; see ``runtime.cpu_kernels``).

The mechanism only: whether the engine uses the kernels is the ``runtime.cpu_kernels`` knob.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.env import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
HALF_DTYPES = (torch.bfloat16, torch.float16)
# Above this many tokens a product widens the weight and calls PyTorch's GEMM (MKL), which has the
# better compute kernel once the weight's bytes are shared by enough tokens (measured: at 128 tokens
# MKL's fp32 GEMM is ~1.6x the native kernel; at 32 they are even; below it the native one wins).
MAX_NATIVE_TOKENS = 32
# The same bound for a MoE layer's fused call, in tokens per expert on average: above it the decoder
# runs experts one by one on PyTorch's GEMM (long prompt chunks).
MAX_NATIVE_TOKENS_PER_EXPERT = 32

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _flags(torch_dir: Path, march: str = "native") -> list[str]:
    # The headers' paths are spelled out rather than taken from torch.utils.cpp_extension, which
    # imports setuptools (absent from Python 3.12's venvs).
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    include = torch_dir / "include"
    return ["-O3", f"-march={march}", "-shared", "-fPIC", "-std=c++17", "-fopenmp", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu"]


def _build(cxx: str, march: str = "native") -> Path:
    """Compile (or find already compiled) the library for ``-march=march``; returns its path."""
    torch_dir = Path(torch.__file__).parent
    flags = _flags(torch_dir, march)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), torch.__version__, sys.version, version, " ".join(flags),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    lib = cache_dir() / "kernels" / key / "moetune_kernels.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    log.info("building moetune's CPU kernels with %s (once per machine; 19 s on a 2-core Ice Lake)", cxx)
    res = subprocess.run([cxx, str(SOURCE), "-o", tmp, *flags], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        os.unlink(tmp)
        lines = res.stderr.strip().splitlines()
        first = next((ln for ln in lines if "error" in ln), lines[0] if lines else "")
        raise RuntimeError(f"{cxx} failed on {SOURCE.name} (exit status {res.returncode}){': ' + first if first else ''}")
    os.replace(tmp, lib)  # atomic: a concurrent process sees no half-written library
    return lib


def load():
    """The ``torch.ops.moetune`` namespace, building it first if needed; None where it cannot be built."""
    with _lock:
        if "ops" in _state:
            return _state["ops"]
        ops = None
        cxx = _compiler()
        _state["compiler"] = shutil.which(cxx) if cxx else None
        try:
            if cxx is None:
                raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
            lib = _build(cxx)
            torch.ops.load_library(str(lib))
            ops = torch.ops.moetune
            _state.update(library=str(lib), isa=ops.isa())
            log.info("moetune CPU kernels: %s (%s)", lib, _state["isa"])
        except Exception as e:  # no compiler, a failed build, an old PyTorch, a foreign platform
            _state["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
            if cxx is None:
                log.warning("moetune's native CPU kernels are unavailable (%s); weights widen to fp32 instead",
                            _state["error"])
            else:
                log.error("moetune's native CPU kernels failed to build or load with %s: %s", cxx, _state["error"])
        _state["ops"] = ops
        return ops


def ops():
    """The loaded ``torch.ops.moetune`` namespace (call only where :func:`load` succeeded)."""
    return _state.get("ops") or load()


def status() -> dict[str, object]:
    """What :func:`load` found: available, isa, library, compiler, error, and ``state``: "available",
    "missing" (no C++ compiler on this machine) or "broken" (a compiler is there; the build or load failed)."""
    load()
    available = _state["ops"] is not None
    state = "available" if available else ("missing" if _state.get("compiler") is None else "broken")
    return {"available": available, "state": state, "isa": _state.get("isa"), "library": _state.get("library"),
            "compiler": _state.get("compiler"), "error": _state.get("error")}


def reads_natively(w: torch.Tensor, x: torch.Tensor) -> bool:
    """True when ``x @ w.T`` runs on the native kernels: fp32 CPU activations, bf16/fp16 CPU weights."""
    return (w.dtype in HALF_DTYPES and x.dtype == torch.float32 and w.device.type == "cpu"
            and x.device.type == "cpu")


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that also takes bf16/fp16 weights with fp32 activations (computed in fp32)."""
    if w.dtype == x.dtype:
        return F.linear(x, w, bias)
    if not reads_natively(w, x):
        raise TypeError(f"linear: {x.dtype} activations with {w.dtype} weights on {w.device}")
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > MAX_NATIVE_TOKENS:
        y = F.linear(rows, w.to(x.dtype), bias)
    else:
        y = load().linear(rows.contiguous(), w, bias)
    return y.reshape(*x.shape[:-1], w.shape[0])


def reads_int8(q: torch.Tensor, x: torch.Tensor) -> bool:
    """True when the native int8 kernel takes ``x @ q.T``: int8 CPU weights, fp32 CPU activations, and
    few enough tokens that a matrix-vector kernel pays (more go through dequantise-then-GEMM)."""
    return (q.dtype == torch.int8 and x.dtype == torch.float32 and q.device.type == "cpu"
            and x.device.type == "cpu" and x.numel() // max(1, x.shape[-1]) <= MAX_NATIVE_TOKENS)


def linear_int8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (q * scales[:, None]).T`` in fp32 for int8 ``q`` [N, K] with one scale per row."""
    rows = x.reshape(-1, x.shape[-1])
    y = ops().linear_int8(rows.contiguous(), q, scales)
    return y.reshape(*x.shape[:-1], q.shape[0])


def moe(h: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
        gates: torch.Tensor) -> torch.Tensor:
    """Routed experts of T tokens in one call: h [T, H] fp32, w13 [E, 2I, H], w2 [E, H, I] (bf16/fp16),
    ids [T, k] int64 (-1 skips a slot), gates [T, k] fp32; returns the gate-weighted sum [T, H] fp32."""
    return load().moe(h.contiguous(), w13, w2, ids.contiguous(), gates.float().contiguous())
