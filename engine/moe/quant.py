"""Weight-only quantization of expert matrices: int8 per output channel, int4 group-wise, and float casts.

Two steps, as in gpt-fast: :func:`quantize` turns one float ``[out, in]`` matrix into a :class:`QWeight`
(offline, or once at load), and :func:`qlinear` computes ``x @ W.T`` from it at run time. The router gate
is never passed through here. A :class:`QWeight` carries its scheme as metadata (precision, group size,
logical shape, layout, kernel), never encoded in a name.

Kernels (chosen once per weight, when it is made or moved; ``QWeight.kernel`` says which):

============  =====================================================  ==========================================
precision     CPU                                                    CUDA
============  =====================================================  ==========================================
fp32/16-bit   ``F.linear`` in the weight's dtype                     ``F.linear`` in the weight's dtype
int8          ``aten._weight_int8pack_mm`` (bf16 activations,        ``aten._weight_int8pack_mm`` where the
              in % 16 == 0); ``dequant`` otherwise                   build has it (probed), else ``dequant``
int4          ``aten._weight_int4pack_mm_for_cpu`` (bf16             ``aten._weight_int4pack_mm`` (tinygemm,
              activations, group 32/64/128/256); ``native``:         bf16), else ``dequant``
              moetune's kernels (``quantize(..., native=True)``)
============  =====================================================  ==========================================

With fp32 activations on the CPU and moetune's native kernels enabled, the hybrid expert executor runs
int8 and int4 weights on :func:`engine.kernels.linear_q` (fp32 accumulation; the path per token count is
the one measured fastest on this machine, e.g. int8 dot products of activations quantized per block of
32). int8 weights keep the layout PyTorch's kernel reads; int4 weights made with ``native=True`` are
stored in the ``int4_native`` layout that moetune's kernels unpack in registers.

``dequant`` is the pure-PyTorch fallback: unpack, scale, then ``F.linear`` in the activation dtype. On the
CPU it is also the better path for many tokens per call (the packed kernels are matrix-vector kernels):
``qlinear(..., path="auto")`` switches to it from :data:`DEQUANT_FROM_TOKENS` tokens. Every kernel is
checked once per device type against the dequantised reference on a small matrix before use
(:func:`kernel_report`); a kernel that is missing or disagrees is replaced by ``dequant``.

Activation dtype: the packed CPU kernels are only vectorised for bf16 activations (with fp32 activations
they run a scalar loop, 5-50x slower, measured), and tinygemm takes only bf16. So activations are cast to
bf16 for the packed kernels and the result cast back to ``x``'s dtype: a copy of ``[T, in]`` and
``[T, out]`` per call, and activations rounded to bf16 (relative 2**-9) before the product. Scales and
zeros are stored in bf16 (what both kernels read) and chosen to be exactly representable there, so
:func:`dequantize` is exactly the weight the kernels use.

Quantization schemes:

* int8: symmetric per output channel, ``w ~= q * s``, ``q`` in [-127, 127], ``s`` bf16 ``[out]``.
* int4: asymmetric per group of ``group_size`` input channels (tinygemm convention),
  ``w ~= (q - 8) * s + z`` with ``q`` in [0, 15] and ``(s, z)`` bf16 ``[in / g, out_pad, 2]``; two values
  per byte; rows padded to a multiple of 16 (the CPU kernel's requirement) so bytes do not depend on
  the device. Layouts: ``int4_cpu`` (the CPU kernel's blocked packing), ``int4_tinygemm`` (int32 tiles
  for CUDA), ``int4_plain`` (``[out_pad, in / 2]`` uint8, even column in the high nibble: portable,
  and what the fallback reads) and ``int4_native`` (``[out_pad, in / 2]`` uint8, each row in chunks of 64
  values in 32 bytes, value j in the low nibble and j + 32 in the high one, which moetune's kernels
  unpack with one shift and two masks; a last chunk of 32 values in 16 bytes where ``in`` is 32 mod 64;
  needs ``in`` and ``group_size`` multiples of 32).
  All four hold ``out_pad * in / 2`` bytes; the scales are the same ``[in / g, out_pad, 2]`` in each.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F

from engine import precision as _precision
from engine.config import knob_default
from engine.precision import check_group_size

log = logging.getLogger(__name__)

Precision = Literal["fp32", "bf16", "fp16", "int8", "int4"]
Layout = Literal["dense", "int8_rows", "int4_cpu", "int4_tinygemm", "int4_plain", "int4_native"]
Kernel = Literal["linear", "int8pack_mm", "int4pack_mm_cpu", "int4pack_mm_tinygemm", "native", "dequant"]

PRECISIONS: tuple[Precision, ...] = _precision.PRECISIONS  # type: ignore[assignment]
FLOAT_DTYPES: dict[str, torch.dtype] = {p: _precision.torch_dtype(p) for p in _precision.FLOAT_PRECISIONS}
KERNEL_GROUP_SIZES = _precision.INT4_GROUP_SIZES
"""int4 group sizes the packed kernels (CPU and tinygemm) accept; others run through ``dequant``."""
INT4_ROW_MULTIPLE = _precision.INT4_ROW_MULTIPLE
"""int4 output rows are padded to this (CPU kernel: N % 16; tinygemm: N % 8)."""
NATIVE_INT4_CHUNK = 32
"""in_features and group_size of the ``int4_native`` layout must be multiples of this (its chunks hold 64
values, with a last one of 32 where in_features is 32 mod 64)."""
_GROUP = knob_default("int4_group_size")  # the registry's default group size
DEQUANT_FROM_TOKENS: dict[tuple[str, str], int] = {("cpu", "int8"): 128, ("cpu", "int4"): 256}
"""(device type, precision) -> tokens per call from which ``path="auto"`` dequantises and runs a dense
product instead of the packed kernel (measured with ``python -m engine.moe.bench_quant``). Absent pairs
always use the kernel."""

DEQUANT_BLOCK_BYTES = 512 * 1024
"""fp32 bytes of weight rows dequantised at a time on the CPU ``dequant`` path (fits L2 with room)."""

_SCALE_DTYPE = torch.bfloat16
assert _SCALE_DTYPE.itemsize == _precision.SCALE_BYTES  # the byte sizes of engine.precision count these
_ACT_DTYPE = torch.bfloat16  # activation dtype of the packed kernels


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def qweight_nbytes(out_features: int, in_features: int, precision: Precision, group_size: int = _GROUP) -> int:
    """Exact bytes :func:`quantize` stores for an ``[out, in]`` matrix in ``precision`` (any device)."""
    return _precision.weight_nbytes(out_features, in_features, precision, group_size)


def expert_nbytes(hidden: int, inter: int, precision: Precision, group_size: int = _GROUP) -> int:
    """Exact bytes of one expert, gate+up ``[2I, H]`` and down ``[H, I]``, without quantizing anything.

    Equals the sum of ``nbytes()`` of the two real :class:`QWeight`; for int4 the group size must divide
    both ``hidden`` and ``inter`` (``ValueError`` otherwise).
    """
    return _precision.expert_nbytes(hidden, inter, precision, group_size)


# ---------------------------------------------------------------------------------------------- QWeight
@dataclass(frozen=True, eq=False)
class QWeight:
    """One ``[out, in]`` weight matrix in one precision, in the layout its device's fastest kernel reads.

    ``data``: dense float ``[out, in]``; int8 ``[out, in]``; int4 packed (see the module docstring).
    ``scales``: int8 bf16 ``[out]``; int4 bf16 ``[in / group_size, out_pad, 2]`` (scale, zero); else None.
    Instances are immutable: :meth:`to` and :meth:`pin` return new ones.
    """

    precision: Precision
    shape: tuple[int, int]
    """Logical ``(out_features, in_features)``."""
    group_size: int | None
    """Input channels per int4 scale; None for other precisions."""
    layout: Layout
    kernel: Kernel
    """What :func:`qlinear` runs on this device (``dequant`` = pure-PyTorch fallback)."""
    data: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def out_padded(self) -> int:
        """Rows stored (int4 pads rows to a multiple of 16; equal to ``shape[0]`` otherwise)."""
        return _round_up(self.shape[0], INT4_ROW_MULTIPLE) if self.precision == "int4" else self.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        return [self.data] + ([self.scales] if self.scales is not None else [])

    def nbytes(self) -> int:
        """Exact bytes of everything stored (equal to :func:`qweight_nbytes` for the same arguments)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def is_pinned(self) -> bool:
        return self.device.type == "cpu" and all(t.is_pinned() for t in self.tensors())

    def pin(self) -> QWeight:
        """Copy into page-locked host memory so that moves to an accelerator can be asynchronous.

        Returns ``self`` when already pinned, when not on the CPU, or when no accelerator exists
        (PyTorch cannot pin memory without one).
        """
        if self.device.type != "cpu" or not torch.cuda.is_available() or self.is_pinned:
            return self
        return replace(self, data=self.data.pin_memory(),
                       scales=None if self.scales is None else self.scales.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> QWeight:
        """The same weight on ``device``, re-laid out for that device's kernel; ``self`` if already there.

        ``non_blocking`` defaults to True for a pinned host copy going to an accelerator; the copy (and
        any re-layout, which runs on the destination) is then ordered on the current stream, so run this
        under ``torch.cuda.stream(s)`` to overlap it and synchronise with ``s`` before use elsewhere.
        int4 from CUDA back to the host decodes tinygemm tiles on the GPU first (one small matrix product).
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device == self.device:
            return self
        if non_blocking is None:
            non_blocking = self.is_pinned and device.type != "cpu"
        if self.precision != "int4":
            data = self.data.to(device, non_blocking=non_blocking)
            scales = None if self.scales is None else self.scales.to(device, non_blocking=non_blocking)
            return replace(self, data=data, scales=scales, kernel=_pick_kernel(self.precision, device, self.shape))
        src = self
        if src.layout == "int4_tinygemm" or (src.layout == "int4_cpu" and not _cpu_layout_decoder_ok()):
            src = _relayout_int4(src, "int4_plain")  # decode where the packing's kernel lives
        assert src.scales is not None
        moved = replace(src, data=src.data.to(device, non_blocking=non_blocking),
                        scales=src.scales.to(device, non_blocking=non_blocking))
        return _relayout_int4(moved, _int4_layout_for(device, src.shape[1], src.group_size or 0))

    def state_dict(self) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
        """Portable (metadata, tensors) for saving: int4 in ``int4_plain`` layout, tensors on the CPU."""
        w = _relayout_int4(self, "int4_plain") if self.precision == "int4" else self
        meta: dict[str, object] = {"precision": w.precision, "shape": list(w.shape), "group_size": w.group_size,
                                   "layout": w.layout}
        tensors = {"data": w.data.cpu()} | ({} if w.scales is None else {"scales": w.scales.cpu()})
        return meta, tensors

    @classmethod
    def from_state_dict(cls, meta: dict[str, object], tensors: dict[str, torch.Tensor],
                        device: torch.device | str = "cpu") -> QWeight:
        """Inverse of :meth:`state_dict`, laid out for ``device``."""
        precision, layout, gs, shape = meta["precision"], meta["layout"], meta["group_size"], meta["shape"]
        if precision not in PRECISIONS or layout not in ("dense", "int8_rows", "int4_plain"):
            raise ValueError(f"not a portable QWeight: precision={precision!r} layout={layout!r}")
        assert isinstance(shape, list | tuple) and (gs is None or isinstance(gs, int))
        n, k = int(shape[0]), int(shape[1])
        device = torch.device(device)
        data = tensors["data"].to(device)
        scales = tensors["scales"].to(device) if "scales" in tensors else None
        if precision == "int4":
            assert gs is not None
            plain = cls("int4", (n, k), gs, "int4_plain", "dequant", data, scales)
            return _relayout_int4(plain, _int4_layout_for(device, k, gs))
        kernel = _pick_kernel(precision, device, (n, k))  # type: ignore[arg-type]
        return cls(precision, (n, k), None, layout, kernel, data, scales)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ quantize
@torch.no_grad()
def quantize(w: torch.Tensor, precision: Precision, group_size: int = _GROUP, native: bool = False) -> QWeight:
    """Quantize (or cast) a float ``[out, in]`` weight on its device; ``group_size`` is used by int4 only.

    ``native``: lay int4 weights out for moetune's native CPU kernels (``int4_native``) where they can read
    them (a CPU weight, the kernels built, in_features and group_size multiples of 32).
    """
    if w.dim() != 2:
        raise ValueError(f"quantize expects a 2-D [out, in] weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    dev = w.device
    if precision in FLOAT_DTYPES:
        data = w.detach().to(FLOAT_DTYPES[precision]).contiguous()
        return QWeight(precision, (n, k), None, "dense", "linear", data)
    wf = w.detach().float().contiguous()
    ops = _native_quantizer(wf)
    if precision == "int8":
        q, s = ops.quantize_int8(wf) if ops is not None else _quantize_int8_torch(wf)
        return QWeight("int8", (n, k), None, "int8_rows", _pick_kernel("int8", dev, (n, k)), q, s)
    if precision == "int4":
        check_group_size(k, group_size)
        layout = _int4_layout_for(dev, k, group_size, native)
        n_pad = _round_up(n, INT4_ROW_MULTIPLE)
        if ops is not None and layout in _KERNEL_PACKS:  # values, scales and packing in one pass
            data, sz = ops.quantize_int4(wf, group_size, n_pad, _KERNEL_PACKS[layout])
        else:
            values, sz = ops.quantize_int4(wf, group_size, n_pad, "values") if ops is not None else \
                _quantize_int4_torch(wf, group_size)
            data = _pack_int4(values, layout)
        return QWeight("int4", (n, k), group_size, layout, _INT4_KERNEL[layout], data, sz)
    raise ValueError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")


#: int4 layouts moetune's kernels pack while they quantize (the others pack from the values in PyTorch).
_KERNEL_PACKS: dict[str, str] = {"int4_plain": "plain", "int4_native": "native"}


def _native_quantizer(wf: torch.Tensor) -> Any:
    """moetune's kernels where they can quantize ``wf`` (a CPU weight, the kernels built), else None: they
    compute the same bits as the PyTorch reference (``_quantize_int8_torch``, ``_quantize_int4_torch``) in
    one pass over the weight, so which one ran changes no result, only the load or reconfigure time."""
    if wf.device.type != "cpu" or not _native_kernels_ok():
        return None
    from engine import kernels

    return kernels.ops()


@torch.no_grad()
def _quantize_int8_torch(wf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 per output channel (the reference): q int8 [N, K] and the bf16 scale [N] it is computed against,
    so that dequantising is exact."""
    amax = wf.abs().amax(dim=1).clamp_min(1e-12)  # [out]
    s = (amax / 127).to(_SCALE_DTYPE)
    q = torch.round(wf / s.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), s


@torch.no_grad()
def quantize_int8_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 with one fp32 scale per ``group`` consecutive weights of a row (as llama.cpp's q8_0 keeps one per
    32): q int8 [N, K] and the scales [N, K / group] (``s = max(amax, 1e-12) / 127``, ``q = round(w / s)``),
    the layout the native kernels' int8 products read beside row scales."""
    n, k = w.shape
    if group <= 0 or k % group:
        raise ValueError(f"int8 group of {group} does not divide the inner size {k}")
    wf = w.detach().float().reshape(n, k // group, group)
    s = wf.abs().amax(dim=2).clamp_min(1e-12) / 127  # [N, K / group]
    q = torch.round(wf / s[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), s.contiguous()


@torch.no_grad()
def dequantize(qw: QWeight) -> torch.Tensor:
    """The float32 ``[out, in]`` weight that :func:`qlinear` multiplies by (exactly, up to fp32 rounding)."""
    n, k = qw.shape
    if qw.precision in FLOAT_DTYPES:
        return qw.data.float()
    if qw.precision == "int8":
        return _dequant_rows(qw, 0, qw.shape[0], torch.float32)
    return _dequant_int4(qw, torch.float32)


def _dequant_int4(qw: QWeight, dtype: torch.dtype) -> torch.Tensor:
    return _dequant_rows(qw, 0, qw.out_padded, dtype)[: qw.shape[0]]


def _dequant_rows(qw: QWeight, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``r0:r1`` of the dequantised weight (int8, or int4 with ``r0`` a multiple of 64 and ``r1`` one
    or the padded row count; int8 rows end at ``shape[0]``)."""
    k = qw.shape[1]
    assert qw.scales is not None
    if qw.precision == "int8":
        return qw.data[r0:r1].to(dtype).mul_(qw.scales[r0:r1, None].to(dtype))
    g = qw.group_size
    assert g is not None
    w = torch.empty(r1 - r0, k, device=qw.device)  # fp32
    _write_int4_values(qw, w, r0, r1)
    sz = qw.scales[:, r0:r1].float()  # [G, r, 2]
    s = sz[..., 0].t()[:, :, None]  # [r, G, 1]
    zs = (sz[..., 1] - 8 * sz[..., 0]).t()[:, :, None]  # w = q * s + (z - 8 s)
    # In place: the out-of-place broadcast over [r, G, g] is ~10x slower on the CPU (measured).
    w.view(r1 - r0, k // g, g).mul_(s).add_(zs)
    return w if dtype == torch.float32 else w.to(dtype)


def _write_int4_values(qw: QWeight, out: torch.Tensor, r0: int, r1: int) -> None:
    """Write the int4 values (0..15) of rows ``r0:r1`` into the float ``[r1 - r0, K]`` tensor ``out``,
    without an unpacked uint8 copy for the two common layouts."""
    k = qw.shape[1]
    p = qw.data
    if qw.layout == "int4_plain":
        o = out.view(r1 - r0, k // 2, 2)
        o[..., 0].copy_(p[r0:r1] >> 4)
        o[..., 1].copy_(p[r0:r1] & 15)
    elif qw.layout == "int4_native":
        out.copy_(_unpack_native(p[r0:r1]))
    elif qw.layout == "int4_cpu" and _cpu_layout_decoder_ok():
        flat = p.reshape(-1)
        block = _cpu_block_rows()
        full = qw.out_padded // block * block
        f1 = min(r1, full)
        if f1 > r0:
            b = flat[r0 * k // 2: f1 * k // 2].view((f1 - r0) // block, k, block // 2).transpose(1, 2)  # [B, b/2, K]
            o = out[: f1 - r0].view((f1 - r0) // block, 2, block // 2, k)
            o[:, 0].copy_(b & 15)
            o[:, 1].copy_(b >> 4)
        if r1 > full:
            r = r1 - full
            b = flat[full * k // 2:].view(k, r // 2).t()  # [r/2, K]
            o = out[full - r0:].view(r // 2, 2, k)
            o[:, 0].copy_(b & 15)
            o[:, 1].copy_(b >> 4)
    else:
        out.copy_(_int4_values(qw)[r0:r1])


def _dequant_linear(x2: torch.Tensor, qw: QWeight) -> torch.Tensor:
    """``x2 @ dequantize(qw).T`` in ``x2``'s dtype. On the CPU the weight is dequantised a block of rows at
    a time (:data:`DEQUANT_BLOCK_BYTES`) and multiplied while the block is in cache: a whole fp32 copy
    makes several trips through DRAM and costs more than the product (measured)."""
    n, k = qw.shape
    if qw.device.type != "cpu":
        return F.linear(x2, _dequant_rows(qw, 0, n, x2.dtype) if qw.precision == "int8"
                        else _dequant_int4(qw, x2.dtype))
    rows_total = n if qw.precision == "int8" else qw.out_padded
    block = max(64, DEQUANT_BLOCK_BYTES // (4 * k) // 64 * 64)
    yt = torch.empty(rows_total, x2.shape[0], dtype=x2.dtype)  # y.T: row blocks are contiguous
    xt = x2.t()
    for r0 in range(0, rows_total, block):
        r1 = min(rows_total, r0 + block)
        torch.mm(_dequant_rows(qw, r0, r1, x2.dtype), xt, out=yt[r0:r1])
    return yt[:n].t().contiguous()


# ------------------------------------------------------------------------------------------- qlinear
def qlinear(x: torch.Tensor, qw: QWeight, path: Literal["auto", "kernel", "dequant"] = "auto") -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[..., in]`` on ``qw``'s device; the result is ``[..., out]`` in ``x``'s dtype.

    ``path``: ``kernel`` runs ``qw.kernel``; ``dequant`` dequantises then runs a dense product in ``x``'s
    dtype; ``auto`` picks by tokens per call (:data:`DEQUANT_FROM_TOKENS`).
    """
    n, k = qw.shape
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # reshapes cost microseconds: skip them for 2-D x
    m = x2.shape[0]
    kernel = qw.kernel
    if kernel == "linear":
        w = qw.data
        y = F.linear(x2 if x2.dtype == w.dtype else x2.to(w.dtype), w)  # 16-bit weights: product in their dtype
        y = y if y.dtype == x.dtype else y.to(x.dtype)
    elif m == 0:
        y = x2.new_empty(0, n)
    else:
        if path == "dequant" or (path == "auto" and m > 1 and m >= DEQUANT_FROM_TOKENS.get(
                (qw.data.device.type, qw.precision), 1 << 62)):
            kernel = "dequant"
        y = None
        if kernel != "dequant":
            try:
                y = _run_kernel(kernel, x2, qw)
                y = y if y.dtype == x.dtype else y.to(x.dtype)
            except RuntimeError as e:  # a shape the probe did not cover: keep serving, say so once
                _warn_once(kernel, qw.shape, e)
        if y is None:
            y = _dequant_linear(x2, qw)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)


def _run_kernel(kernel: Kernel, x2: torch.Tensor, qw: QWeight) -> torch.Tensor:
    if kernel == "native":  # moetune's kernels: fp32 activations, on the path measured fastest here
        from engine import kernels

        xf = x2 if x2.dtype == torch.float32 and x2.is_contiguous() else x2.float().contiguous()
        return kernels.linear_q(xf, qw, force=True)
    xa = x2 if x2.dtype == _ACT_DTYPE and x2.is_contiguous() else x2.to(_ACT_DTYPE).contiguous()
    if kernel == "int8pack_mm":
        return torch.ops.aten._weight_int8pack_mm.default(xa, qw.data, qw.scales)
    if kernel == "int4pack_mm_cpu":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu.default(xa, qw.data, qw.group_size, qw.scales)
    elif kernel == "int4pack_mm_tinygemm":
        y = torch.ops.aten._weight_int4pack_mm.default(xa, qw.data, qw.group_size, qw.scales)
    else:
        raise RuntimeError(f"unknown kernel {kernel!r}")
    n = qw.shape[0]
    return y if y.shape[1] == n else y[:, :n]


_warned: set[tuple[str, tuple[int, int]]] = set()


def _warn_once(kernel: str, shape: tuple[int, int], err: Exception) -> None:
    if (kernel, shape) in _warned:
        return
    _warned.add((kernel, shape))
    log.warning("quant: %s failed for shape %s (%s); using dequant", kernel, shape, str(err).splitlines()[0])


# ------------------------------------------------------------------------------ kernel choice, probes
def _pick_kernel(precision: Precision, device: torch.device, shape: tuple[int, int]) -> Kernel:
    if precision in FLOAT_DTYPES:
        return "linear"
    if precision == "int8":
        # The CPU kernel reads K in blocks of 16 and crashes (SIGSEGV, torch 2.13) on other widths.
        return "int8pack_mm" if shape[1] % 16 == 0 and _int8_kernel_ok(device.type) else "dequant"
    raise AssertionError("int4 kernels follow the layout")


def _int4_layout_for(device: torch.device, in_features: int, group_size: int, native: bool = False) -> Layout:
    if (native and device.type == "cpu" and in_features % group_size == 0 and group_size % NATIVE_INT4_CHUNK == 0
            and _native_kernels_ok()):
        return "int4_native"
    if group_size in KERNEL_GROUP_SIZES and in_features % group_size == 0:
        if device.type == "cpu" and _int4_kernel_ok("cpu"):
            return "int4_cpu"
        if device.type == "cuda" and _int4_kernel_ok("cuda"):
            return "int4_tinygemm"
    return "int4_plain"


_INT4_KERNEL: dict[str, Kernel] = {"int4_cpu": "int4pack_mm_cpu", "int4_tinygemm": "int4pack_mm_tinygemm",
                                   "int4_plain": "dequant", "int4_native": "native"}


def _native_kernels_ok() -> bool:
    from engine import kernels

    return kernels.load() is not None


def _probe_device(device_type: str) -> torch.device | None:
    if device_type == "cpu":
        return torch.device("cpu")
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _probe_weight(device: torch.device, n: int = 48, k: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(n, k, generator=g).to(device)


def _agrees(y: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool(((y.float() - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-3).item())


@functools.cache
def _int8_kernel_ok(device_type: str) -> bool:
    """Whether ``_weight_int8pack_mm`` exists and agrees with the reference on this device type."""
    dev = _probe_device(device_type)
    if dev is None or not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return False
    try:
        w = _probe_weight(dev)
        q = torch.round(w * 20).clamp(-127, 127).to(torch.int8)
        s = torch.linspace(0.5, 2, w.shape[0], device=dev).to(_SCALE_DTYPE)
        x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(7)).to(dev, _ACT_DTYPE)
        y = torch.ops.aten._weight_int8pack_mm(x, q, s)
        ok = _agrees(y, x.float() @ (q.float() * s.float()[:, None]).t())
    except (RuntimeError, NotImplementedError) as e:
        log.info("quant: _weight_int8pack_mm unavailable on %s (%s)", device_type, str(e).splitlines()[0])
        return False
    log.info("quant: _weight_int8pack_mm on %s: %s", device_type, "ok" if ok else "disagrees, not used")
    return ok


@functools.cache
def _int4_kernel_ok(device_type: str) -> bool:
    """Whether the int4 pack and matmul ops exist and agree with the reference on this device type."""
    dev = _probe_device(device_type)
    ops = (("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu") if device_type == "cpu"
           else ("_convert_weight_to_int4pack", "_weight_int4pack_mm"))
    if dev is None or not all(hasattr(torch.ops.aten, o) for o in ops):
        return False
    try:
        w = _probe_weight(dev)
        qw = _quantize_int4_plain(w, 64)
        packed = _relayout_int4(qw, "int4_cpu" if device_type == "cpu" else "int4_tinygemm")
        x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(7)).to(dev, _ACT_DTYPE)
        y = _run_kernel(_INT4_KERNEL[packed.layout], x, packed)
        ok = _agrees(y, x.float() @ _dequant_int4(qw, torch.float32).t())
        if ok and device_type == "cuda":  # moving back to the host decodes tinygemm tiles with the kernel
            ok = torch.equal(_decode_with_kernel(packed), _int4_values(qw))
    except (RuntimeError, NotImplementedError) as e:
        log.info("quant: int4 kernels unavailable on %s (%s)", device_type, str(e).splitlines()[0])
        return False
    log.info("quant: int4 kernels on %s: %s", device_type, "ok" if ok else "disagree, not used")
    return ok


@functools.cache
def _cpu_block_rows() -> int | None:
    """Rows per block of ``_convert_weight_to_int4pack_for_cpu`` in this build (64 on AVX-512, 32 on
    AVX2), verified by inverting the op on several shapes; None where neither inverts it."""
    if not _int4_kernel_ok("cpu"):
        return None
    g = torch.Generator().manual_seed(99)
    probes = []
    for n in (16, 48, 64, 80, 144):
        q = torch.randint(0, 16, (n, 64), generator=g, dtype=torch.int32)
        probes.append((n, q, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)))
    for block in (64, 32):
        if all(packed.dtype == torch.uint8 and torch.equal(_decode_cpu_layout(packed, n, 64, block), q.to(torch.uint8))
               for n, q, packed in probes):
            return block
    log.info("quant: int4 CPU packing differs from the known layouts; decoding through the kernel")
    return None


def _cpu_layout_decoder_ok() -> bool:
    """Whether :func:`_decode_cpu_layout` inverts ``_convert_weight_to_int4pack_for_cpu`` in this build."""
    return _cpu_block_rows() is not None


def kernel_report() -> dict[str, dict[str, str]]:
    """Which kernel each precision uses per available device type (for logs and results)."""
    out: dict[str, dict[str, str]] = {}
    for dt in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        out[dt] = {p: "linear" for p in FLOAT_DTYPES}
        out[dt]["int8"] = "int8pack_mm" if _int8_kernel_ok(dt) else "dequant"
        out[dt]["int4"] = _INT4_KERNEL[_int4_layout_for(torch.device(dt), 1024, 128)]
    return out


# ---------------------------------------------------------------------------------------- int4 layouts
def _quantize_int4_plain(w: torch.Tensor, group_size: int) -> QWeight:
    """Group-wise asymmetric int4 (tinygemm convention) in the portable layout, by the reference."""
    values, sz = _quantize_int4_torch(w, group_size)
    return QWeight("int4", tuple(w.shape), group_size, "int4_plain", "dequant", _pack_plain(values), sz)


@torch.no_grad()
def _quantize_int4_torch(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric int4 (tinygemm convention; the reference): the values uint8 [N', K] in [0, 15]
    (rows padded to :data:`INT4_ROW_MULTIPLE` with zero rows) and (s, z) bf16 [G, N', 2], exact in bf16."""
    n, k = w.shape
    n_pad = _round_up(n, INT4_ROW_MULTIPLE)
    wf = torch.zeros(n_pad, k, device=w.device)
    wf[:n] = w.float()
    wg = wf.view(n_pad, k // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    s = ((hi - lo) / 15).clamp_min(1e-12).to(_SCALE_DTYPE).float()  # [N', G]
    z = (lo + 8 * s).to(_SCALE_DTYPE).float()  # zero point in the float domain: w = (q - 8) * s + z
    q = torch.round((wg - z[..., None]) / s[..., None] + 8).clamp_(0, 15).to(torch.uint8).view(n_pad, k)
    sz = torch.stack([s, z], dim=-1).transpose(0, 1).to(_SCALE_DTYPE).contiguous()  # [G, N', 2]
    return q, sz


def _pack_int4(values: torch.Tensor, layout: Layout) -> torch.Tensor:
    """uint8 values [N', K] in [0, 15] packed for ``layout`` (on their device)."""
    if layout == "int4_plain":
        return _pack_plain(values)
    if layout == "int4_native":
        return _pack_native(values)
    if layout == "int4_cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), 2)
    k = values.shape[1]
    inner_k_tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
    return torch.ops.aten._convert_weight_to_int4pack(_pack_plain(values), inner_k_tiles)


def _pack_plain(q: torch.Tensor) -> torch.Tensor:
    """uint8 values [N, K] in [0, 15] -> [N, K/2], even column in the high nibble (tinygemm's input)."""
    return ((q[:, ::2] << 4) | q[:, 1::2]).contiguous()


def _unpack_plain(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([p >> 4, p & 15], dim=-1).view(p.shape[0], -1)


def _pack_native(q: torch.Tensor) -> torch.Tensor:
    """uint8 values [N, K] in [0, 15] -> [N, K/2] in the ``int4_native`` order: chunks of 64 values in 32
    bytes, byte j holding value j (low nibble) and value j + 32 (high nibble); where K is 32 mod 64, a
    last chunk of 32 values in 16 bytes (j low, j + 16 high)."""
    n, k = q.shape
    k64 = k // 64 * 64
    c = q[:, :k64].reshape(n, k64 // 64, 2, 32)
    parts = [(c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k64 // 2)]
    if k > k64:
        t = q[:, k64:].reshape(n, 2, 16)
        parts.append(t[:, 0] | (t[:, 1] << 4))
    return torch.cat(parts, dim=1).contiguous() if len(parts) > 1 else parts[0].contiguous()


def _unpack_native(p: torch.Tensor) -> torch.Tensor:
    n, k = p.shape[0], p.shape[1] * 2
    k64 = k // 64 * 64
    b = p[:, : k64 // 2].reshape(n, k64 // 64, 32)
    parts = [torch.cat([b & 15, b >> 4], dim=-1).reshape(n, k64)]
    if k > k64:
        t = p[:, k64 // 2:]
        parts.append(torch.cat([t & 15, t >> 4], dim=-1))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _decode_cpu_layout(p: torch.Tensor, n: int, k: int, block: int | None = None) -> torch.Tensor:
    """Invert ``_convert_weight_to_int4pack_for_cpu`` (torch 2.6-2.13): rows in blocks of ``block`` (64
    where the op was built for AVX-512, 32 for AVX2), each stored as ``[K, block/2]`` bytes, low nibble
    row ``j``, high nibble row ``j + block/2``; the last ``N % block`` rows as ``[K, r/2]`` bytes, low
    nibble row ``2j``, high nibble row ``2j + 1``. The block is found and verified against the op at
    first use (:func:`_cpu_block_rows`)."""
    block = block or _cpu_block_rows()
    assert block, "the CPU int4 layout is unknown in this build"
    half = block // 2
    flat = p.reshape(-1)
    full = n // block * block
    parts = []
    if full:
        b = flat[: full * k // 2].view(full // block, k, half)  # [B, K, block/2]
        parts.append(torch.cat([b & 15, b >> 4], dim=2).transpose(1, 2).reshape(full, k))
    if n > full:
        b = flat[full * k // 2:].view(k, (n - full) // 2)  # [K, r/2]
        parts.append(torch.stack([b & 15, b >> 4], dim=2).view(k, n - full).t())
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()


def _decode_with_kernel(qw: QWeight) -> torch.Tensor:
    """uint8 values [N', K] of a packed int4 weight, read back through its own kernel: an identity
    matrix times the weight with scale 1 and zero 0 gives ``q - 8`` exactly (small integers in bf16)."""
    n_pad, k = qw.out_padded, qw.shape[1]
    assert qw.group_size is not None
    eye = torch.eye(k, device=qw.device, dtype=_ACT_DTYPE)
    unit = torch.zeros(k // qw.group_size, n_pad, 2, device=qw.device, dtype=_SCALE_DTYPE)
    unit[..., 0] = 1
    probe = replace(qw, scales=unit, shape=(n_pad, k))
    y = _run_kernel(_INT4_KERNEL[qw.layout], eye, probe)  # [K, N']
    return (y.float().t() + 8).round().to(torch.uint8).contiguous()


def _int4_values(qw: QWeight) -> torch.Tensor:
    """uint8 values [N', K] in [0, 15] of an int4 weight, on its device."""
    n_pad, k = qw.out_padded, qw.shape[1]
    if qw.layout == "int4_plain":
        return _unpack_plain(qw.data)
    if qw.layout == "int4_native":
        return _unpack_native(qw.data)
    if qw.layout == "int4_cpu" and _cpu_layout_decoder_ok():
        return _decode_cpu_layout(qw.data, n_pad, k)
    return _decode_with_kernel(qw)


def _relayout_int4(qw: QWeight, layout: Layout) -> QWeight:
    """The same int4 weight in ``layout`` on its device (the packing ops run where the data is)."""
    if qw.layout == layout:
        return qw
    return replace(qw, layout=layout, kernel=_INT4_KERNEL[layout], data=_pack_int4(_int4_values(qw), layout))
