"""moetune's native CPU kernels: fp32 products that read bf16/fp16/int8/int4 weights as stored.

``cpu_kernels.cpp`` is compiled on first use with the system C++ compiler (``$CXX``, else ``c++``)
against the installed PyTorch, for this CPU (``-march=native``), and kept in the cache directory
under a key of the source, PyTorch, compiler and CPU flags; later processes load it in milliseconds.
Where they cannot be had, :func:`load` returns None with the reason in :func:`status`, which tells
the two cases apart: no C++ compiler at all (``missing``: the engine may widen weights to fp32 and use
PyTorch's products, and says so in every result) and a compiler whose build or load fails (``broken``:
a bug, which the engine refuses to paper over; see ``runtime.cpu_kernels``).

One library holds the kernels for several instruction sets (scalar, AVX2, AVX-VNNI, AVX-512,
AVX512_VNNI, AVX512_BF16; see the source's header); the library picks the best one this CPU runs
from CPUID (:func:`variants`). Which *path* a product takes (ISA variant and arithmetic mode, or
PyTorch's GEMM) is chosen per precision and token count from measurements made once per machine
(:func:`prepare`, cached by ``engine.calibrate.kernel_paths``); :func:`dispatch_report` says what was
chosen and why. The mechanism only: whether the engine uses the kernels is the ``runtime.cpu_kernels``
knob.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.env import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
HALF_DTYPES = (torch.bfloat16, torch.float16)
MAX_NATIVE_TOKENS_PER_EXPERT = 32
"""Kept for callers of the previous API: the measured crossover now decides (:func:`fused_moe`)."""

ISA_VARIANTS = ("scalar", "avx2", "avx_vnni", "avx512", "avx512_vnni", "avx512_bf16", "amx")
"""The ISA variants compiled into the library, from least to most preferred."""
PRECISIONS = ("bf16", "fp16", "int8", "int4")
"""Weight precisions the native products read."""
TOKEN_POINTS = (1, 4, 16, 64, 256, 1024, 4096)
"""Tokens per product at which the paths are measured; a token count between two points takes the
path of the nearer one (geometric midpoints). 1024 and 4096 (a long prompt's chunk) since 2026-12-05: on
the AMX Xeon, with weights evicted, tiles led oneDNN's bf16 products at 256 tokens, where the table ended,
and so took every count above; from cache, 768 x 1024, ms, tiles against oneDNN: 1.63 / 1.47 at 1024
tokens, 7.85 / 3.04 at 4096."""

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


def _compile(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run the compiler in its own process group, so that an interrupted build (Ctrl-C, a test's timeout)
    stops the compiler's own children too (``cc1plus`` outlives a killed ``g++``)."""
    # Its own session means a terminal's Ctrl-C no longer reaches the compiler: this process must stop it.
    # An interrupt that landed inside Popen (the compiler already started, ``proc`` not yet bound) would
    # leave it running, so SIGINT and SIGTERM wait until ``proc`` exists.
    held = {signal.SIGINT, signal.SIGTERM}
    blocked = threading.current_thread() is threading.main_thread()
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
    try:
        out, err = proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


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
    try:
        res = _compile([cxx, str(SOURCE), "-o", tmp, *flags])
    except BaseException:
        os.unlink(tmp)
        raise
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


# ------------------------------------------------------------------------------ ISA variants and paths
def variants() -> dict[str, list[str]]:
    """The ISA variants compiled into the library and those this CPU runs (CPUID and XGETBV)."""
    compiled, runnable = ops().variants()
    return {"compiled": list(compiled), "runnable": list(runnable)}


def cpu_features() -> list[str]:
    """What CPUID and XGETBV report that the kernels care about (``avx2``, ``avx512_bf16``, ``amx_tile``, ...)."""
    return list(ops().cpu_features())


def attention_kernels(head_dim: int = 64, variant: str = "") -> dict[str, str]:
    """The variants whose kernels serve attention for ``head_dim`` on ``variant`` (default: the chosen one; any
    compiled one, runnable here or not), following its fallbacks as the ops do: ``decode`` (decode_attention) and ``prompts`` (prefill_attention,
    blocks of 16 tokens of a KV head), each "" where no variant has one (decode: a scalar loop; prompts: token
    by token as decode attends). Every vector variant has both for head sizes that are a multiple of 8."""
    decode, prompts = ops().attention_kernels(head_dim, variant)
    return {"decode": str(decode), "prompts": str(prompts)}


def amx_present() -> bool:
    """Whether this CPU has AMX tiles for bf16 and the OS enables their state (CPUID, XGETBV)."""
    return {"amx_tile", "amx_bf16", "os_amx"} <= set(cpu_features())


_PRECISION_OF = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "int8", torch.uint8: "int4"}


def candidate_paths(precision: str, runnable: list[str], amx: bool = False) -> list[str]:
    """Every path a product of ``precision`` weights can take on a CPU running ``runnable`` variants.

    Native paths are ``"variant:mode"`` (modes: ``f32`` fp32 products of weights widened in registers;
    ``q8`` int8 dot products of activations quantized per block of 32; ``q16`` int16 dot products (int8
    weights sign-extended in registers) of activations quantized per block of 32 to int16; ``bf16dp`` vdpbf16ps on
    activations rounded to bf16; ``tile`` AMX tiles on activations rounded to bf16, the weights read as
    stored). PyTorch's: ``torch:widen`` (its fp32 GEMM on a copy of the weight
    widened per call), ``torch:bf16`` (oneDNN's bf16 products: only where the CPU multiplies bf16 natively,
    with AMX tiles (``amx``) or AVX512_BF16; elsewhere oneDNN emulates them) and ``torch:quant`` (its packed
    int8/int4 kernels on bf16 activations). A variant
    that differs from a lower one only in instructions a mode does not use is not listed for that mode.
    """
    f32 = [v for v in runnable if v in ("avx2", "avx512")] or ["scalar"]
    q8 = [v for v in runnable if v in ("avx2", "avx_vnni", "avx512", "avx512_vnni")] or ["scalar"]
    q16 = [v for v in runnable if v in ("avx2", "avx512")] or ["scalar"]  # vpmaddwd: no VNNI instruction
    if precision == "bf16":
        return ([f"{v}:f32" for v in f32] + (["avx512_bf16:bf16dp"] if "avx512_bf16" in runnable else [])
                + (["amx:tile"] if "amx" in runnable else []) + ["torch:widen"]
                + (["torch:bf16"] if amx or "avx512_bf16" in runnable else []))
    if precision == "fp16":
        return [f"{v}:f32" for v in f32] + ["torch:widen"]
    if precision == "int8":
        return [f"{v}:f32" for v in f32] + [f"{v}:q8" for v in q8] + [f"{v}:q16" for v in q16] + ["torch:quant"]
    if precision == "int4":
        return [f"{v}:q8" for v in q8] + ["torch:quant"]
    raise ValueError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")


def _boundaries(points: tuple[int, ...]) -> list[int]:
    """Largest token count served by each measured point: the geometric midpoints between points."""
    return [int(math.sqrt(a * b)) for a, b in zip(points, points[1:], strict=False)]


#: experts.int8_activations -> the arithmetics int8 products may take, the faster measured
#: (:func:`set_int8_activations`): ``auto`` the faster of the two that keep the activations to 15 bits or more.
INT8_ACTIVATION_MODES: dict[str, tuple[str, ...]] = {
    "auto": ("f32", "q16"), "fp32": ("f32",), "int16": ("q16",), "int8": ("q8",)}
#: Arithmetics as close to fp32 activations as no PyTorch path that rounds them to bf16 is (torch:quant).
NEAR_FP32 = ("f32", "q16")

#: Native modes that compute alike: activations rounded to bf16, their exact products with the bf16 weights
#: summed in fp32 (vdpbf16ps pairs; AMX tiles). They differ only in the order of the sums, as the f32 mode's
#: variants do, so one arithmetic takes either at any token count.
ARITHMETIC = {"bf16dp": "bf16", "tile": "bf16"}


def arithmetic(path: str) -> str:
    """The arithmetic of a native ``variant:mode`` path: its mode, or the class of modes it computes alike in."""
    mode = path.split(":")[1]
    return ARITHMETIC.get(mode, mode)


#: PyTorch paths that multiply the fp32 activations as they are (torch:quant rounds them to bf16; torch:bf16 too).
FP32_TORCH_PATHS = ("torch:widen",)


def choose_paths(times_s: dict[str, dict[str, dict[str, float]]], points: tuple[int, ...] = TOKEN_POINTS,
                 modes: dict[str, str | tuple[str, ...]] | None = None) -> dict[str, dict[str, object]]:
    """The path table from measured times (pure: no torch, no device). ``times_s[precision][path][str(T)]``
    is the best time of one product of ``T`` tokens.

    Per precision: one native arithmetic for every token count (so that a result does not depend on how a
    step's tokens are split: a mode, or modes that compute alike, :data:`ARITHMETIC`), the one with the
    smallest geometric-mean slowdown against the fastest native path over the points; then per point the
    fastest of its paths and of PyTorch's. (On a 2-core Xeon with AMX, 2026-12-04, AMX tiles were 3-4x
    vdpbf16ps from 16 tokens on, but 27 % slower at one token, where a batch-1 decode ran 31.9 -> 42.3
    tok/s on vdpbf16ps: one arithmetic with both modes in it takes each where it is fastest.) int4 is
    all-native or all-PyTorch (the two read different layouts), decided at one token (decode).
    ``crossover_tokens``: from this token count on, PyTorch's GEMM is used (None: never).
    ``modes``: the arithmetic a precision must take (``{"int8": "f32"}``: fp32 activations on int8 weights,
    :func:`set_int8_activations`), whatever is fastest, or the arithmetics it may take (a tuple: the fastest of
    them, as above); its PyTorch paths are then only those that keep the fp32 activations
    (:data:`FP32_TORCH_PATHS`) where those arithmetics are :data:`NEAR_FP32` (int16 keeps more of each
    activation than torch:quant's bf16 rounding).
    """
    bounds = _boundaries(points)
    table: dict[str, dict[str, object]] = {}
    for prec, by_path in times_s.items():
        native = {p: t for p, t in by_path.items() if not p.startswith("torch:")}
        torch_paths = {p: t for p, t in by_path.items() if p.startswith("torch:")}
        best = {str(n): min(t[str(n)] for t in native.values()) for n in points}

        def slowdown(arith: str, native=native, best=best) -> float:
            return sum(math.log(min(t[str(n)] for p, t in native.items() if arithmetic(p) == arith) / best[str(n)])
                       for n in points)

        have = sorted({arithmetic(p) for p in native})
        wanted = (modes or {}).get(prec)
        allowed = [a for a in ((wanted,) if isinstance(wanted, str) else wanted or ()) if a in have]
        mode = min(allowed or have, key=slowdown)
        if allowed and all(a in NEAR_FP32 for a in allowed):  # no PyTorch path that rounds the activations to bf16
            torch_paths = {p: t for p, t in torch_paths.items() if p in FP32_TORCH_PATHS}
        mine = {p: t for p, t in native.items() if arithmetic(p) == mode}
        native_best = [min(mine, key=lambda p, n=n: mine[p][str(n)]) for n in points]
        if prec == "int4":
            tq = torch_paths.get("torch:quant")
            winners = (["torch:quant"] * len(points) if tq and tq[str(points[0])] < mine[native_best[0]][str(points[0])]
                       else native_best)
        else:
            pool = {**mine, **torch_paths}
            winners = [min(pool, key=lambda p, n=n: pool[p][str(n)]) for n in points]
        ranges: list[list[object]] = []
        for i, w in enumerate(winners):
            upper = bounds[i] if i < len(bounds) else None
            if ranges and ranges[-1][1] == w:
                ranges[-1][0] = upper
            else:
                ranges.append([upper, w])
        native_ranges = [[bounds[i] if i < len(bounds) else None, w] for i, w in enumerate(native_best)]
        crossover = None
        for i in range(len(points)):
            if all(w.startswith("torch:") for w in winners[i:]):
                crossover = 1 if i == 0 else bounds[i - 1] + 1
                break
        table[prec] = {"mode": mode, "ranges": ranges, "native_ranges": native_ranges, "crossover_tokens": crossover}
    return table


_forced: dict[str, str] = {}
#: The arithmetics int8 weights' products may take (experts.int8_activations), the faster measured: "f32"
#: (fp32 activations, the weights widened in registers), "q16" (activations quantized per block of 32 to
#: int16, int16 dot products) or "q8" (activations quantized per block of 32 to int8, llama.cpp's q8_0).
_modes: dict[str, tuple[str, ...]] = {"int8": INT8_ACTIVATION_MODES["auto"]}


def modes() -> dict[str, tuple[str, ...]]:
    """The arithmetics a precision may take, the fastest of them (``choose_paths(modes=)``)."""
    return dict(_modes)


def set_int8_activations(activations: str) -> None:
    """How int8 weights meet the activations (the engine applies ``experts.int8_activations``): ``auto`` (the
    default), the faster here of ``fp32`` and ``int16``, which score alike; ``fp32``, the f32 mode (the
    products of the int8 weights alone: top-1 agreement 0.996 with int8 experts on the medium preset, where q8
    gave 0.988 on an AMX Xeon, 2026-12-05); ``int16``, the q16 mode, activations quantized per token in blocks
    of 32 to int16 (15 bits a block: on an AVX2 EPYC, 2026-12-07, `engine eval` gave fp32's top-1 0.9961 and
    mean KL 1.464e-6 to four digits, and batch-1 decode ran 43.7 -> 55.6 tok/s, integer products skipping the
    weights' widening to fp32); ``int8``, the q8 mode, activations quantized per token in blocks of 32 to int8
    (faster where products are compute-bound: batch-32 decode 346 -> 393 tok/s on the AMX Xeon).
    The path table is chosen again (from the cached times) when this changes."""
    if activations not in INT8_ACTIVATION_MODES:
        raise ValueError(f"int8 activations {activations!r}: expected one of {', '.join(INT8_ACTIVATION_MODES)}")
    mode = INT8_ACTIVATION_MODES[activations]
    if _modes.get("int8") != mode:
        _modes["int8"] = mode
        _state.pop("paths_threads", None)


@contextmanager
def forced_paths(**by_precision: str) -> Iterator[None]:
    """Use a fixed path for the named precisions whatever the token count (tests; comparisons of paths).
    A value without a colon is a mode on the default variant (``bf16="f32"``)."""
    before = dict(_forced)
    _forced.update({p: v if ":" in v else f":{v}" for p, v in by_precision.items()})
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(before)


@contextmanager
def on_variant(name: str) -> Iterator[None]:
    """Make ISA variant ``name`` the default (every op's kernels, attention's included, and the paths without
    a variant) for the block, then the best one this CPU runs again (tests; comparisons of variants)."""
    ops().set_isa(name)
    try:
        yield
    finally:
        ops().set_isa("auto")


def prepare() -> dict[str, dict[str, object]]:
    """The path table for this machine, software and thread count: measured once (a few seconds) and
    cached by :func:`engine.calibrate.kernel_paths`; the engine calls this when it loads a model."""
    threads = torch.get_num_threads()
    if _state.get("paths_threads") != threads:
        from engine.calibrate import kernel_paths

        _state["paths"] = kernel_paths()
        _state["paths_threads"] = threads
        from engine.calibrate import moe_vector_tokens

        _state["moe_vector_tokens"] = moe_vector_tokens()  # after the table: it asks whether tiles are in it
    return _state["paths"]["table"]  # type: ignore[index]


def _lookup(ranges: list[list[object]], tokens: int) -> str:
    for upper, p in ranges:
        if upper is None or tokens <= upper:  # type: ignore[operator]
            return str(p)
    return str(ranges[-1][1])


def path(precision: str, tokens: int) -> str:
    """The path a product of ``precision`` weights with ``tokens`` activation rows takes here."""
    forced = _forced.get(precision)
    if forced is not None:
        return forced
    return _lookup(prepare()[precision]["ranges"], tokens)  # type: ignore[arg-type]


def native_path(precision: str, tokens: int) -> str:
    """The fastest native path for ``precision`` at ``tokens`` (even where PyTorch's is faster)."""
    forced = _forced.get(precision)
    if forced is not None and not forced.startswith("torch:"):
        return forced
    return _lookup(prepare()[precision]["native_ranges"], tokens)  # type: ignore[arg-type]


def _fit(p: str, inner: int) -> str:
    """q8, q16, bf16dp and tile read blocks of 32 activations: other inner sizes take the f32 mode."""
    if inner % 32 and p.endswith((":q8", ":q16", ":bf16dp", ":tile")):
        return p.split(":")[0] + ":f32"
    return p


# ------------------------------------------------------------------------------ products
def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that also takes bf16/fp16 weights with fp32 activations (computed in fp32 on the
    measured path for this token count: native, or PyTorch's GEMM on the widened weight)."""
    if w.dtype == x.dtype:
        return F.linear(x, w, bias)
    if not reads_natively(w, x):
        raise TypeError(f"linear: {x.dtype} activations with {w.dtype} weights on {w.device}")
    rows = x.reshape(-1, x.shape[-1])
    p = path(_PRECISION_OF[w.dtype], rows.shape[0])
    if p == "torch:widen":
        y = F.linear(rows, w.to(x.dtype), bias)
    elif p == "torch:bf16":
        y = F.linear(rows.to(w.dtype), w).to(x.dtype)
        if bias is not None:
            y = y + bias
    else:
        y = load().linear_q(rows.contiguous(), w, None, 0, 0, _fit(p, w.shape[1]), bias)
    return y.reshape(*x.shape[:-1], w.shape[0])


def linear_q(x: torch.Tensor, qw, force: bool = False) -> torch.Tensor | None:
    """``x @ W.T`` in fp32 for an int8 or ``int4_native`` :class:`engine.moe.quant.QWeight` ``qw`` on the
    native kernels, on the measured path for its precision and this token count. Returns None where
    that path is PyTorch's (the caller runs ``quant.qlinear``), unless ``force`` (then the fastest
    native path runs)."""
    if qw.precision == "int4" and qw.layout != "int4_native":
        if force:
            raise ValueError(f"linear_q: int4 layout {qw.layout!r} is not the native kernels' (int4_native)")
        return None
    rows = x.reshape(-1, x.shape[-1])
    p = path(qw.precision, rows.shape[0])
    if p.startswith("torch:"):
        if not force:
            return None
        p = native_path(qw.precision, rows.shape[0])
    y = ops().linear_q(rows.contiguous(), qw.data, qw.scales, qw.group_size or 0, qw.shape[0],
                       _fit(p, qw.shape[1]), None)
    return y.reshape(*x.shape[:-1], qw.shape[0])


def reads_int8(q: torch.Tensor, x: torch.Tensor) -> bool:
    """True when :func:`linear_int8` takes ``x @ q.T``: int8 CPU weights, fp32 CPU activations, and a
    token count whose measured int8 path is native."""
    return (q.dtype == torch.int8 and x.dtype == torch.float32 and q.device.type == "cpu"
            and x.device.type == "cpu" and not path("int8", x.numel() // max(1, x.shape[-1])).startswith("torch:"))


def int8_path(tokens: int, grouped: bool = False) -> str:
    """The native path of int8 products at ``tokens`` tokens: the measured one, or with ``grouped`` (a scale
    per group of 32 or more weights of a row) where it is the f32 mode, its variant's q8 mode, which applies
    those scales per block of 32 as it goes (the f32 mode would run group by group; q16 applies them per
    block too)."""
    p = native_path("int8", tokens)
    return p.split(":")[0] + ":q8" if grouped and not p.endswith(":q16") else p


def linear_int8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(q).T + bias`` in fp32 for int8 ``q`` [N, K] with one scale per row (``scales`` [N]) or
    per group of a row (``scales`` [N, K / group], fp32), on the native int8 path for this token count."""
    rows = x.reshape(-1, x.shape[-1])
    path_ = _fit(int8_path(rows.shape[0], scales.dim() == 2), q.shape[1])
    y = ops().linear_q(rows.contiguous(), q, scales, 0, q.shape[0], path_, bias)
    return y.reshape(*x.shape[:-1], q.shape[0])


def fused_moe(precision: str | torch.dtype, tokens_per_expert: float) -> bool:
    """Whether a MoE layer whose experts see ``tokens_per_expert`` tokens on average runs in one native
    call (:func:`moe`, :func:`moe_experts`); else expert by expert, each on its token count's path.

    Native where the products' table is native at that count, and on AMX tiles at any count: tiles read an
    expert's rows once for all its tokens, and the fused MoE beat the experts one by one on oneDNN's bf16
    products where a dense product did not (AMX Xeon, 2026-12-05, medium preset, batch-32 prefill of 512
    tokens an expert, `engine compare-hf`: 706.7 tok/s expert by expert, 1150-1242 fused)."""
    prec = _PRECISION_OF[precision] if isinstance(precision, torch.dtype) else precision
    n = max(1, round(tokens_per_expert))
    if not path(prec, n).startswith("torch:"):
        return True
    return prec not in _forced and native_path(prec, n).endswith(":tile")


def moe_path(precision: str, tokens_per_expert: float, hidden: int, inter: int) -> str:
    """The native path of a fused MoE layer whose experts see ``tokens_per_expert`` tokens on average.

    On AMX tiles each expert takes the mode of its own token count: ``variant:tile/N`` runs the experts
    routed at most N tokens on vdpbf16ps (one arithmetic, :data:`ARITHMETIC`), N measured on this machine
    (:func:`engine.calibrate.moe_vector_tokens`). Routing is skewed: at batch 32 of the medium preset an
    expert sees 7.6 tokens on average, some 1 and others 30. So where tiles are bf16's native path at any
    token count, the MoE takes ``variant:tile/N`` whatever the average: the dense products' crossover (where
    vdpbf16ps leads up to 8 tokens) would run every expert, the one with 30 tokens too, on vdpbf16ps (AMX
    Xeon, 2026-12-05, medium preset at batch 32: 370 -> 285 tok/s)."""
    p = _fit(native_path(precision, max(1, round(tokens_per_expert))), min(hidden, inter))
    if precision != "bf16" or precision in _forced:
        return p
    ranges = prepare()[precision]["native_ranges"]
    tile = next((_fit(q, min(hidden, inter)) for _, q in ranges if q.endswith(":tile")), "")  # type: ignore[union-attr]
    if not tile.endswith(":tile"):
        return p
    n = int(_state.get("moe_vector_tokens", 0))  # type: ignore[arg-type]
    return f"{tile}/{n}" if n else tile


def moe(h: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
        gates: torch.Tensor) -> torch.Tensor:
    """Routed experts of T tokens in one call: h [T, H] fp32, w13 [E, 2I, H], w2 [E, H, I] (bf16/fp16),
    ids [T, k] int64 (-1 skips a slot), gates [T, k] fp32; returns the gate-weighted sum [T, H] fp32."""
    p = moe_path(_PRECISION_OF[w13.dtype], ids.numel() / w13.shape[0], w13.shape[2], w2.shape[2])
    return load().moe(h.contiguous(), w13, w2, ids.contiguous(), gates.float().contiguous(), p)


def moe_stacked(h: torch.Tensor, experts, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """:func:`moe` for stacked experts in any precision the kernels read: ``experts`` is an
    :class:`engine.moe.experts.StackedExperts` (int8 with row scales, int4 in the native layout with group
    scales, or bf16/fp16), one tensor per weight and scale with the experts along its first dimension."""
    p = moe_path(experts.precision, ids.numel() / experts.n_experts, experts.hidden, experts.inter)
    return load().moe(h.contiguous(), experts.w13, experts.w2, ids.contiguous(), gates.float().contiguous(), p,
                      experts.s13, experts.s2, experts.group_size or 0)


def moe_experts(h: torch.Tensor, w13: list, w2: list, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """:func:`moe` with the experts given per expert: bf16/fp16 tensors or int8/``int4_native``
    :class:`engine.moe.quant.QWeight` (one precision per call), None for experts no token routes to."""
    first = next(w for w in w13 if w is not None)
    quantized = not isinstance(first, torch.Tensor)
    prec = first.precision if quantized else _PRECISION_OF[first.dtype]
    p = moe_path(prec, ids.numel() / len(w13), first.shape[1], first.shape[0] // 2)  # shape [2I, H]
    if quantized:
        d13 = [None if w is None else w.data for w in w13]
        d2 = [None if w is None else w.data for w in w2]
        s13 = [None if w is None else w.scales for w in w13]
        s2 = [None if w is None else w.scales for w in w2]
        group = first.group_size or 0
    else:
        d13, d2, s13, s2, group = w13, w2, [], [], 0
    return ops().moe_q(h.contiguous(), d13, s13, d2, s2, ids.contiguous(), gates.float().contiguous(), group, p)


# ------------------------------------------------------------------------------ what was chosen
def dispatch_report() -> dict[str, object]:
    """The chosen path per precision and token-count range, with the ISA, AMX and measured peaks: what
    ``engine doctor`` prints and what results record."""
    st = status()
    if not st["available"]:
        return {"available": False, "error": st["error"]}
    measured = _state.get("paths") or {}
    prepare()
    measured = _state["paths"]
    feats = cpu_features()
    var = variants()
    has_amx = amx_present()
    table: dict = measured["table"]  # type: ignore[assignment]
    peaks: dict = measured.get("peak_gflops", {})  # type: ignore[assignment]
    bf16_torch = peaks.get("bf16", {}).get("torch:bf16")
    used = any(p == "torch:bf16" for _, p in table.get("bf16", {}).get("ranges", []))
    onednn = (f"oneDNN's bf16 products measured {bf16_torch:.0f} GFLOP/s at best, "
              + ("used above the crossover" if used else "slower than the native kernels here, not used"))
    if has_amx:
        n = _state.get("moe_vector_tokens", 0)
        detail = f"present; {onednn}" + (f"; a MoE's experts of up to {n} tokens on vdpbf16ps, tiles above (measured)"
                                        if n else "")
    else:
        detail = ("absent: CPUID reports no AMX tiles (amx_tile, amx_bf16)" if "amx_tile" not in feats
                  else "absent: the OS does not enable AMX tile state (XCR0)")
        detail += (f"; AVX512_BF16: {onednn}" if "torch:bf16" in candidate_paths("bf16", var["runnable"])
                   else "; PyTorch's oneDNN bf16 products (emulated without AMX or AVX512_BF16) are not a candidate path")
    return {"available": True, "isa": ops().isa(), "compiled": var["compiled"], "runnable": var["runnable"],
            "cpu_features": feats, "amx": {"present": has_amx, "mkldnn": torch.backends.mkldnn.is_available(),
                                           "detail": detail},
            "paths": {p: {k: v for k, v in t.items() if k != "native_ranges"} for p, t in table.items()},
            "forced": dict(_forced), "peak_gflops": peaks, "measured_shape": measured.get("shape"),
            "moe_vector_tokens": _state.get("moe_vector_tokens", 0),
            "token_points": measured.get("points"), "attention": attention_kernels()}


def dispatch_summary() -> str:
    """One line: the ISA and each precision's paths by token count (for tables and result records)."""
    st = status()
    if not st["available"]:
        return "torch (native kernels unavailable)"
    parts = [str(ops().isa())]
    for prec, t in prepare().items():
        if prec in _forced:
            parts.append(f"{prec} {_forced[prec]} (forced)")
            continue
        ranges = t["ranges"]  # type: ignore[index]
        desc = ", ".join(f"{p} <={u}" if u is not None else (f"{p} above" if i else p)
                         for i, (u, p) in enumerate(ranges))  # type: ignore[misc]
        parts.append(f"{prec} {desc}")
    att = attention_kernels()
    parts.append(f"attention {att['decode'] or 'scalar'}, prompts {att['prompts'] or 'token by token'}")
    return "; ".join(parts)

