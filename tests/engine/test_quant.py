"""Weight-only quantization: kernels against the dequantise-then-matmul reference, error bounds, exact bytes.

The oracle for every product is ``x @ dequantize(qw).T`` in fp32. Tolerances:

* fp32 weights and the ``dequant`` path compute in fp32: ``rtol=1e-5``, ``atol=1e-5 * max|ref|``.
* The packed int8/int4 kernels and bf16/fp16 weights compute on 16-bit activations and return 16-bit
  results: the reference uses the same rounded activations, and the result may differ by its own
  rounding (2**-9 relative for bf16) plus accumulation order: ``rtol=2**-8``, ``atol=1e-3 * max|ref|``.

Quantization error bounds (relative Frobenius error on Gaussian weights): int8 < 1%, int4 (group 128)
< 15% (uniform step over a group's range: ~9% expected), bf16 < 0.4%, fp16 < 0.05%.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.moe import quant as Q
from engine.moe.quant import QWeight, check_group_size, dequantize, expert_nbytes, qlinear, quantize

SHAPES = [(1, 64), (7, 128), (33, 256), (80, 128), (144, 64)]  # [out, in]: one row, odd, N % 64 != 0
TOKENS = [1, 7, 64]


def CUDA(f):  # noqa: N802 - reads as a marker
    """GPU test: marked ``gpu`` and skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(f))


def _weight(n: int, k: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * k ** -0.5).to(device)


def _x(m: int, k: int, seed: int = 1, device: str = "cpu") -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(device)


def _group(k: int) -> int:
    return 64 if k % 128 else 128


def _reference(x: torch.Tensor, qw: QWeight, path: str) -> tuple[torch.Tensor, float, float]:
    """(reference result, rtol, atol factor) for what ``qlinear(x, qw, path)`` computes."""
    w = dequantize(qw)
    if qw.kernel == "linear" and qw.precision != "fp32":
        xr = x.to(qw.data.dtype).float()
    elif qw.kernel not in ("linear", "dequant") and path != "dequant":
        xr = x.bfloat16().float()  # packed kernels run on bf16 activations
    else:
        return x.float() @ w.t(), 1e-5, 1e-5
    return xr @ w.t(), 2**-8, 1e-3


def _check(y: torch.Tensor, x: torch.Tensor, qw: QWeight, path: str) -> None:
    ref, rtol, atol = _reference(x, qw, path)
    assert y.shape == ref.shape and y.dtype == x.dtype and y.device == x.device
    torch.testing.assert_close(y.float(), ref, rtol=rtol, atol=atol * ref.abs().max().item() + 1e-7)


# ------------------------------------------------------------------------------------- products (CPU)
@pytest.mark.parametrize("precision", Q.PRECISIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("m", TOKENS)
def test_qlinear_matches_dequantized_reference(precision, shape, m):
    n, k = shape
    qw = quantize(_weight(n, k), precision, _group(k))
    x = _x(m, k)
    for path in ("kernel", "dequant", "auto"):
        _check(qlinear(x, qw, path), x, qw, path)


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_cpu_uses_packed_kernels_where_the_build_has_them(precision):
    qw = quantize(_weight(64, 256), precision, 128)
    want = {"int8": ("_weight_int8pack_mm", "int8pack_mm"),
            "int4": ("_weight_int4pack_mm_for_cpu", "int4pack_mm_cpu")}[precision]
    assert hasattr(torch.ops.aten, want[0]), f"torch {torch.__version__} has no {want[0]}"
    assert qw.kernel == want[1]
    assert Q.kernel_report()["cpu"][precision] == want[1]


def test_bf16_activations_and_leading_dims():
    qw = quantize(_weight(48, 128), "int4", 64)
    x = _x(6, 128).bfloat16().view(2, 3, 128)
    y = qlinear(x, qw)
    assert y.shape == (2, 3, 48) and y.dtype == torch.bfloat16
    ref = x.float().view(6, 128) @ dequantize(qw).t()
    torch.testing.assert_close(y.float().view(6, 48), ref, rtol=2**-7, atol=2e-3 * ref.abs().max().item())


def test_zero_tokens():
    for precision in Q.PRECISIONS:
        qw = quantize(_weight(16, 64), precision, 64)
        assert qlinear(torch.empty(0, 64), qw).shape == (0, 16)


def test_auto_switches_to_dequant_from_the_threshold(monkeypatch):
    qw = quantize(_weight(32, 128), "int8", 64)
    x = _x(5, 128)
    monkeypatch.setitem(Q.DEQUANT_FROM_TOKENS, ("cpu", "int8"), 5)
    assert torch.equal(qlinear(x, qw, "auto"), qlinear(x, qw, "dequant"))
    monkeypatch.setitem(Q.DEQUANT_FROM_TOKENS, ("cpu", "int8"), 6)
    assert torch.equal(qlinear(x, qw, "auto"), qlinear(x, qw, "kernel"))


def test_dequant_path_blocks_rows_exactly(monkeypatch):
    """The CPU fallback dequantises in row blocks: block edges (and int4's partial last block) must not
    change the result."""
    monkeypatch.setattr(Q, "DEQUANT_BLOCK_BYTES", 64 * 4 * 64)  # 64 rows of 64 columns
    for precision in ("int8", "int4"):
        qw = quantize(_weight(150, 64), precision, 32)
        x = _x(9, 64)
        torch.testing.assert_close(qlinear(x, qw, "dequant"), x @ dequantize(qw).t(), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------- quantization error
@pytest.mark.parametrize("precision,bound", [("fp32", 0.0), ("fp16", 5e-4), ("bf16", 4e-3), ("int8", 0.01),
                                             ("int4", 0.15)])
def test_quantization_error_within_bound(precision, bound):
    w = _weight(256, 1024)
    rel = ((dequantize(quantize(w, precision, 128)) - w).norm() / w.norm()).item()
    assert rel <= bound, f"{precision}: relative error {rel:.4f} > {bound}"


def test_int4_error_shrinks_with_group_size():
    w = _weight(64, 1024)
    errs = [((dequantize(quantize(w, "int4", g)) - w).norm() / w.norm()).item() for g in (256, 128, 64, 32)]
    assert errs == sorted(errs, reverse=True) and errs[-1] < 0.1


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_degenerate_rows(precision):
    w = _weight(32, 128)
    w[0] = 0
    w[1] = 0.25  # constant row: zero range in every group
    w[2, :64] = 1e-30
    d = dequantize(quantize(w, precision, 64))
    assert torch.isfinite(d).all()
    assert torch.equal(d[0], torch.zeros(128))
    torch.testing.assert_close(d[1], torch.full((128,), 0.25), rtol=2**-8, atol=0)


def test_scales_exact_in_bf16():
    """The integers are computed against the stored bf16 scales (not the fp32 scales before rounding), so
    the stored (q, scales) pair is exactly the weight that ``dequantize`` and the kernels multiply by."""
    w = _weight(16, 128)
    q8 = quantize(w, "int8")
    assert q8.scales is not None and q8.scales.dtype == torch.bfloat16
    s = q8.scales.float()[:, None]
    assert torch.equal(q8.data, torch.round(w / s).clamp(-127, 127).to(torch.int8))  # nearest against s itself
    assert torch.equal(dequantize(q8), q8.data.float() * s)
    q4 = Q._relayout_int4(quantize(w, "int4", 64), "int4_plain")
    assert q4.scales is not None and q4.scales.dtype == torch.bfloat16
    sz = q4.scales.float()[:, :16]  # [G, N, 2]: per group and row, scale and zero point as stored
    scale = sz[..., 0].t().repeat_interleave(64, dim=1)  # [N, K]
    zero = sz[..., 1].t().repeat_interleave(64, dim=1)
    values = Q._int4_values(q4)[:16].float()
    assert torch.equal(values, torch.round((w - zero) / scale + 8).clamp(0, 15))  # nearest against stored (s, z)
    torch.testing.assert_close(dequantize(q4), (values - 8) * scale + zero, rtol=2**-22, atol=0)


# --------------------------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("precision", Q.PRECISIONS)
@pytest.mark.parametrize("shape", SHAPES + [(768, 1024), (1024, 384)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_nbytes_exact(precision, shape):
    n, k = shape
    g = _group(k)
    qw = quantize(_weight(n, k), precision, g)
    n_pad = -(-n // 16) * 16
    want = {"fp32": 4 * n * k, "bf16": 2 * n * k, "fp16": 2 * n * k, "int8": n * k + 2 * n,
            "int4": n_pad * k // 2 + (k // g) * n_pad * 4}[precision]
    assert qw.nbytes() == want == Q.qweight_nbytes(n, k, precision, g)
    assert qw.nbytes() == sum(t.numel() * t.element_size() for t in (qw.data, qw.scales) if t is not None)


@pytest.mark.parametrize("precision", Q.PRECISIONS)
@pytest.mark.parametrize("hidden,inter,group", [(1024, 384, 128), (256, 96, 32), (64, 48, 16)])
def test_expert_nbytes_equals_real_weights(precision, hidden, inter, group):
    w13, w2 = _weight(2 * inter, hidden), _weight(hidden, inter, seed=1)
    real = quantize(w13, precision, group).nbytes() + quantize(w2, precision, group).nbytes()
    assert expert_nbytes(hidden, inter, precision, group) == real


def test_medium_expert_bytes():
    assert expert_nbytes(1024, 384, "fp32") == 4_718_592
    assert expert_nbytes(1024, 384, "int8") == 3 * 1024 * 384 + 2 * (768 + 1024)
    assert expert_nbytes(1024, 384, "int4", 128) == 3 * 1024 * 384 // 2 + 4 * (8 * 768 + 3 * 1024)


# ------------------------------------------------------------------------------------- validation
def test_bad_group_size_is_a_one_line_error():
    with pytest.raises(ValueError) as e:
        check_group_size(1024, 96, "hidden_size")
    assert str(e.value) == "int4 group_size=96 does not divide hidden_size=1024"
    with pytest.raises(ValueError, match=r"^int4 group_size=256 does not divide expert_intermediate=384$"):
        expert_nbytes(1024, 384, "int4", 256)
    with pytest.raises(ValueError, match=r"group_size=0 must be positive"):
        check_group_size(1024, 0, "hidden_size")
    with pytest.raises(ValueError, match=r"^int4 group_size=64 does not divide in_features=100$"):
        quantize(_weight(8, 100), "int4", 64)
    with pytest.raises(ValueError, match="precision='int2'"):
        quantize(_weight(8, 64), "int2", 64)  # type: ignore[arg-type]
    check_group_size(1024, 128, "hidden_size")  # fine


def test_other_widths_fall_back_to_dequant():
    """int8 with in % 16 != 0 (the CPU kernel crashes there) and int4 with a group size the kernels do not
    take run the pure-PyTorch path and stay correct."""
    q8 = quantize(_weight(5, 40), "int8")
    assert q8.kernel == "dequant"
    q4 = quantize(_weight(20, 64), "int4", 16)
    assert (q4.layout, q4.kernel) == ("int4_plain", "dequant")
    for qw, k in ((q8, 40), (q4, 64)):
        x = _x(3, k)
        _check(qlinear(x, qw), x, qw, "auto")


# --------------------------------------------------------------------------------- layouts, moves
@pytest.mark.parametrize("n", [1, 16, 48, 64, 80, 144, 784])
def test_int4_cpu_layout_decoding(n):
    assert Q._int4_kernel_ok("cpu"), f"torch {torch.__version__}: the CPU int4 kernel is missing or disagrees"
    assert Q._cpu_layout_decoder_ok()
    qw = quantize(_weight(n, 128), "int4", 64)
    assert qw.layout == "int4_cpu"
    plain = Q._relayout_int4(qw, "int4_plain")
    values = Q._int4_values(plain)
    assert torch.equal(Q._int4_values(qw), values)
    assert torch.equal(Q._decode_with_kernel(qw), values)  # the path used where the layout is unknown
    assert torch.equal(Q._relayout_int4(plain, "int4_cpu").data, qw.data)
    assert torch.equal(dequantize(plain), dequantize(qw))
    x = _x(7, 128)
    _check(qlinear(x, plain), x, plain, "auto")


@pytest.mark.parametrize("precision", Q.PRECISIONS)
def test_state_dict_round_trip(precision):
    qw = quantize(_weight(40, 128), precision, 64)
    meta, tensors = qw.state_dict()
    json.dumps(meta)  # plain metadata: scheme and group size are fields, never parsed from names
    assert meta["precision"] == precision and meta["group_size"] == (64 if precision == "int4" else None)
    back = QWeight.from_state_dict(json.loads(json.dumps(meta)), tensors)
    assert (back.layout, back.kernel, back.shape) == (qw.layout, qw.kernel, qw.shape)
    assert torch.equal(dequantize(back), dequantize(qw))
    assert back.nbytes() == qw.nbytes()


def test_to_same_device_and_pin_without_accelerator():
    qw = quantize(_weight(16, 64), "int4", 32)
    assert qw.to("cpu") is qw
    if not torch.cuda.is_available():
        assert qw.pin() is qw and not qw.is_pinned


# ------------------------------------------------------------------------------------------- CUDA
@CUDA
@pytest.mark.parametrize("precision", Q.PRECISIONS)
@pytest.mark.parametrize("shape", [(1, 128), (33, 256), (768, 1024), (1024, 384)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_cuda_qlinear_matches_reference(precision, shape, m):
    n, k = shape
    host = quantize(_weight(n, k), precision, 128 if k % 128 == 0 else 64).pin()
    qw = host.to("cuda")
    assert qw.device.type == "cuda" and qw.nbytes() == host.nbytes()
    torch.testing.assert_close(dequantize(qw).cpu(), dequantize(host), rtol=1e-6, atol=1e-7)
    for dtype in (torch.bfloat16, torch.float32):
        x = _x(m, k, device="cuda").to(dtype)
        for path in ("kernel", "dequant"):
            y = qlinear(x, qw, path)
            ref, _, _ = _reference(x.float(), qw, path)
            tol = 2e-2 if dtype == torch.bfloat16 or precision in ("bf16", "fp16", "int8", "int4") else 1e-4
            assert y.shape == (m, n) and y.dtype == dtype
            torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * _output_scale(x, qw, ref))


def _output_scale(x: torch.Tensor, qw: QWeight, ref: torch.Tensor) -> float:
    """The size of an output whose terms do not cancel: the larger of the largest output and the root of
    k products' squares. CUDA's int8 kernel rounds the dequantized weights to bf16 (H100, torch 2.11): on
    one output of 128 terms that summed to 0.025 it was off by 0.0024, 0.2 % of this scale (1.07)."""
    w = dequantize(qw).to(x.device)
    rms_terms = ((x.float() ** 2) @ (w.float() ** 2).t()).sqrt().max().item()
    return max(ref.abs().max().item(), rms_terms)


@CUDA
def test_cuda_kernels_chosen():
    report = Q.kernel_report()["cuda"]
    if hasattr(torch.ops.aten, "_weight_int4pack_mm") and torch.cuda.get_device_capability() >= (8, 0):
        assert report["int4"] == "int4pack_mm_tinygemm"
    print("cuda kernels:", report)


@CUDA
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_cuda_round_trip_and_quantize_on_device(precision):
    w = _weight(80, 256)
    host = quantize(w, precision, 64)
    dev = host.to("cuda")
    back = dev.to("cpu")
    assert back.layout == host.layout and torch.equal(back.data, host.data)
    assert torch.equal(back.scales, host.scales)
    on_dev = quantize(w.cuda(), precision, 64)  # same arithmetic on the GPU: rounding ties may differ
    same = torch.isclose(dequantize(on_dev).cpu(), dequantize(host), rtol=1e-5, atol=1e-7)
    assert same.float().mean() > 0.999
    meta, tensors = host.state_dict()
    loaded = QWeight.from_state_dict(meta, tensors, "cuda")
    assert loaded.layout == dev.layout and torch.equal(dequantize(loaded), dequantize(dev))


# --------------------------------------------------------------------------------- int4_native layout

def _native_reference(x: torch.Tensor, qw: QWeight) -> torch.Tensor:
    """What the native int4 path computes: ``scale * sum((q - 8) * x_q8) + zero * sum(x)`` per group,
    x_q8 the activations as the kernels' own ``quantize_q8`` quantizes them for int4 weights of this group
    (per block of 32, or of 64 where the group is a multiple of 64)."""
    from engine import kernels

    q, d, gsum = kernels.ops().quantize_q8(x.float().contiguous(), qw.group_size)
    t, k = x.shape
    n, g = qw.shape[0], qw.group_size
    xq = (q.float().view(t, k // 32, 32) * d[:, :, None]).view(t, k // g, g)
    vals = Q._int4_values(qw)[:n].float().view(n, k // g, g)
    s, z = qw.scales[:, :n, 0].t().float(), qw.scales[:, :n, 1].t().float()
    return torch.einsum("tgk,ngk,ng->tn", xq, vals - 8, s) + torch.einsum("tg,ng->tn", gsum, z)


@pytest.mark.parametrize("shape", [(1, 64), (7, 128), (33, 256), (144, 64)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("group", [32, 64])
def test_int4_native_layout_holds_the_same_weight(shape, group, native_kernels):
    """The native layout (32-value chunks, q4_0 nibble order) is a permutation of the plain one: same
    values, same bytes, same dequantized weight; it round-trips through every other layout."""
    n, k = shape
    w = _weight(n, k, seed=n)
    plain = quantize(w, "int4", group)
    native = quantize(w, "int4", group, native=True)
    assert (native.layout, native.kernel) == ("int4_native", "native")
    assert native.nbytes() == plain.nbytes() == Q.qweight_nbytes(n, k, "int4", group)
    assert torch.equal(Q._int4_values(native), Q._int4_values(plain))
    assert torch.equal(dequantize(native), dequantize(plain))
    assert torch.equal(Q._relayout_int4(Q._relayout_int4(native, "int4_plain"), "int4_native").data, native.data)
    assert torch.equal(Q._unpack_native(Q._pack_native(Q._int4_values(plain))), Q._int4_values(plain))
    # byte j of each 32-byte chunk: value j in the low nibble, value j + 32 in the high one; a row of
    # 32 mod 64 values ends in a 16-byte chunk (j low, j + 16 high)
    v = Q._int4_values(plain)
    assert int(native.data[0, 3]) == int(v[0, 3]) | (int(v[0, 35]) << 4)
    tail = quantize(_weight(16, 96), "int4", 32, native=True)
    tv = Q._int4_values(tail)
    assert int(tail.data[0, 32 + 5]) == int(tv[0, 64 + 5]) | (int(tv[0, 64 + 21]) << 4)
    meta, tensors = native.state_dict()
    assert meta["layout"] == "int4_plain" and torch.equal(dequantize(QWeight.from_state_dict(meta, tensors)),
                                                          dequantize(native))


@pytest.mark.parametrize("m", [1, 7, 64])
def test_qlinear_on_the_native_int4_kernel(m, native_kernels):
    qw = quantize(_weight(80, 128), "int4", 64, native=True)
    x = _x(m, 128)
    ref = _native_reference(x, qw)
    y = qlinear(x, qw, "kernel")
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    yb = qlinear(x.bfloat16(), qw, "kernel")  # bf16 activations are widened for the kernel, the result cast back
    assert yb.dtype == torch.bfloat16
    _check(qlinear(x, qw, "dequant"), x, qw, "dequant")  # the pure-PyTorch path reads the layout too
    # Against the unquantized activations: int8 activation rounding costs under a percent here (0.6-0.7 %; 1-2.7 %
    # when the -8 scale term took the exact sums of x, before 2026-12-08)
    exact = x @ dequantize(qw).t()
    assert float((y - exact).norm() / exact.norm()) < 0.01


def test_native_layout_only_where_the_kernels_read_it(native_kernels):
    assert quantize(_weight(16, 96), "int4", 32, native=True).layout == "int4_native"
    assert quantize(_weight(16, 64), "int4", 16, native=True).layout != "int4_native"  # group not a multiple of 32
    assert quantize(_weight(16, 64), "int4", 64).layout != "int4_native"  # not asked for


# ------------------------------------------------------------------------- native quantization (CPU)

def _awkward_weights(n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    """Weights whose quantization has edge cases: constant groups (s at its floor), one outlier a row,
    huge and tiny magnitudes, values already in bf16, and halves exactly between two int levels."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    const = w.clone()
    const[::2] = 0.25
    const[1::3, : k // 2] = -3.0
    outlier = w.clone()
    outlier[:, seed % k] = 1e4
    levels = torch.randint(0, 16, (n, k), generator=g).float() * 0.5 + 0.25  # halves between steps
    return {"gauss": w * k**-0.5, "const": const, "outlier": outlier, "huge": w * 1e30, "tiny": w * 1e-30,
            "bf16": w.bfloat16().float(), "levels": levels}


@pytest.mark.parametrize("shape", [(1, 64), (7, 128), (33, 256), (80, 96), (640, 512)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_native_quantization_is_the_reference_bit_for_bit(shape, native_kernels):
    """The kernels' one-pass int8/int4 quantization gives the same bytes as the PyTorch reference, for every
    group size that divides the row, on weights with edge cases; ``quantize`` uses it on the CPU."""
    from engine import kernels

    n, k = shape
    ops = kernels.ops()
    for name, w in _awkward_weights(n, k, seed=n + k).items():
        q, s = ops.quantize_int8(w)
        rq, rs = Q._quantize_int8_torch(w)
        assert torch.equal(q, rq) and torch.equal(s, rs), f"int8 {name}"
        n_pad = Q._round_up(n, Q.INT4_ROW_MULTIPLE)
        for group in (gs for gs in (16, 32, 64, 128) if k % gs == 0):
            v, sz = ops.quantize_int4(w, group, n_pad, "values")
            rv, rsz = Q._quantize_int4_torch(w, group)
            assert v.shape == rv.shape and torch.equal(v, rv), f"int4 values {name} group {group}"
            assert torch.equal(sz, rsz), f"int4 scales {name} group {group}"
            for pack, packer in (("plain", Q._pack_plain), ("native", Q._pack_native)):
                p, psz = ops.quantize_int4(w, group, n_pad, pack)
                assert torch.equal(p, packer(rv)) and torch.equal(psz, rsz), f"int4 {pack} {name} group {group}"
    assert Q._native_quantizer(_weight(8, 64)) is not None  # the CPU path takes the kernels here


def test_native_quantization_refuses_bad_shapes_in_one_line(native_kernels):
    from engine import kernels

    ops = kernels.ops()
    with pytest.raises(RuntimeError, match="multiple of the group size"):
        ops.quantize_int4(_weight(8, 96), 64, 64, "native")
    with pytest.raises(RuntimeError, match="n_pad"):
        ops.quantize_int4(_weight(80, 64), 32, 64, "native")
    with pytest.raises(RuntimeError, match="not one of values, plain, native"):
        ops.quantize_int4(_weight(8, 64), 32, 64, "tinygemm")
    with pytest.raises(RuntimeError, match="cannot be packed as native"):
        ops.quantize_int4(_weight(8, 48), 16, 64, "native")
    with pytest.raises(RuntimeError, match="float32"):
        ops.quantize_int8(_weight(8, 64).bfloat16())
