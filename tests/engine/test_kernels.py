"""The native CPU kernels (engine/kernels): products read from bf16/fp16/int8/int4 weights as stored.

Each op is checked against PyTorch on shapes that hit every tile and tail: token counts 1..9 around
the register tiles (2-4 tokens) and past the 64-token block, rows not a multiple of 4, inner sizes
not a multiple of the vector. Oracles and tolerances:

* f32 mode: the same weights widened to fp32 (only the summation order differs): rtol 1e-5 and an
  absolute 2e-6 of the result's largest magnitude (fp32 sums of up to 1024 products);
* q8 mode: the activations the op quantized (``quantize_q8``: int8 per block of 32 with an fp32 scale)
  times the dequantized weights, the same tolerance (the integer products are exact);
* bf16dp: activations rounded to bf16 times the bf16 weights, rtol 1e-5.

Every ISA variant this CPU runs is checked in-process (:func:`engine.kernels.variants`); the others
are compiled into the same library and checked for their instructions in its machine code. Then the
engine: a bf16 checkpoint run with the kernels gives the logits and greedy tokens of the same checkpoint
run with PyTorch in fp32, with half the weight bytes; int8 and int4 experts against their references.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import kernels
from engine.config import ConfigError, EngineConfig
from engine.model.arch import DENSE_INT8_GROUP
from engine.runtime import Engine


@pytest.fixture(autouse=True)
def _kernels_built(require_component):
    """A compiler that fails is a failure with its first error; only a machine with no C++ compiler at all
    skips these tests (and fails under MOETUNE_TEST_STRICT=1, as in CI)."""
    st = kernels.status()
    if st["state"] == "broken":
        pytest.fail(f"the native kernels do not build with {st['compiler']}: {st['error']}", pytrace=False)
    require_component("a C++ compiler", st["state"] != "missing", "apt-get install g++", str(st["error"]))


def test_kernels_build_where_a_compiler_exists():
    """The first thing to read when the kernels break: the compiler's first error, not a skip."""
    st = kernels.status()
    assert st["available"], f"{st['state']}: {st['error']}"
    assert st["state"] == "available" and st["compiler"] and st["error"] is None


def _runnable() -> list[str]:
    return kernels.variants()["runnable"]


def _refused(variant: str) -> bool:
    """True (after checking the refusal) where this CPU cannot run ``variant``: its paths must be refused
    with the reason rather than run (a variant compiled for instructions the CPU lacks would crash)."""
    if variant in _runnable():
        return False
    with pytest.raises(RuntimeError, match=f"cannot run the {variant} kernels|unknown ISA variant '{variant}'"):
        _ops().linear_q(torch.randn(1, 32), torch.randn(4, 32).bfloat16(), None, 0, 0, f"{variant}:f32", None)
    return True

HALF = [torch.bfloat16, torch.float16]
# fp32 sums of up to a few hundred products in another order: a few ulps of the result's scale.
RTOL, ATOL = 1e-5, 1e-5


def _ops():
    return kernels.load()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("rows,inner", [(37, 100), (64, 1024), (5, 16), (3, 7)])
def test_linear_matches_fp32_product(dtype, tokens, rows, inner):
    g = torch.Generator().manual_seed(tokens * 1000 + rows + inner)
    x = torch.randn(tokens, inner, generator=g)
    w = torch.randn(rows, inner, generator=g).to(dtype)
    b = torch.randn(rows, generator=g)
    ref = F.linear(x, w.float(), b)
    torch.testing.assert_close(_ops().linear(x, w, b), ref, rtol=RTOL, atol=ATOL * inner ** 0.5)
    torch.testing.assert_close(_ops().linear(x, w, None), F.linear(x, w.float()), rtol=RTOL,
                               atol=ATOL * inner ** 0.5)
    wf = w.float()  # fp32 weights (routers) too
    torch.testing.assert_close(_ops().linear(x, wf, b), ref, rtol=RTOL, atol=ATOL * inner ** 0.5)


def test_linear_wrapper_keeps_leading_dims_on_every_path():
    w = torch.randn(24, 48).bfloat16()
    x3 = torch.randn(2, 3, 48)
    for p in ("f32", "torch:widen"):  # native, and PyTorch's GEMM on the widened weight
        with kernels.forced_paths(bf16=p):
            torch.testing.assert_close(kernels.linear(x3, w), F.linear(x3, w.float()), rtol=RTOL, atol=1e-4)
    many = torch.randn(300, 48)  # past the last measured point: whatever path the table says
    if kernels.path("bf16", 300) == "torch:bf16":  # oneDNN's bf16 products (AMX): bf16 in, bf16 out
        torch.testing.assert_close(kernels.linear(many, w), F.linear(many.bfloat16(), w).float())
    else:
        torch.testing.assert_close(kernels.linear(many, w), F.linear(many, w.float()), rtol=RTOL, atol=1e-4)
    same = torch.randn(5, 48).bfloat16()  # same dtypes: plain F.linear
    assert torch.equal(kernels.linear(same, w), F.linear(same, w))


def _q8_dequant(x: torch.Tensor) -> torch.Tensor:
    """The activations the q8 mode multiplies with: x quantized per row and block of 32, dequantized."""
    q, d, _ = _ops().quantize_q8(x.contiguous(), 0)
    t, k = x.shape
    return (q.float().view(t, k // 32, 32) * d[:, :, None]).view(t, k)


def _q16_dequant(x: torch.Tensor) -> torch.Tensor:
    """The activations the q16 mode multiplies with: x quantized per row and block of 32 to int16, dequantized."""
    q, d = _ops().quantize_q16(x.contiguous())
    t, k = x.shape
    return (q.float().view(t, k // 32, 32) * d[:, :, None]).view(t, k)


#: The activations each mode multiplies with (f32: as they are), and the integer levels of its blocks.
_ACTS = {"f32": lambda x: x, "q8": _q8_dequant, "q16": _q16_dequant}
_LEVELS = {"q8": 127, "q16": 32767}


def test_q16_activations_keep_15_bits_a_block():
    """quantize_q16: per block of 32, d = max|x| / 32767 and q = round(x / d), so each value is within half a
    step of x (and a zero block stays zero); q8's step is 258 times as coarse."""
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e-3, 1.0, 1e3])[:, None]
    x[1, 32:64] = 0
    q, d = _ops().quantize_q16(x)
    assert q.dtype == torch.int16 and d.shape == (3, 3)
    blocks = x.view(3, 3, 32)
    torch.testing.assert_close(d, blocks.abs().amax(-1) / 32767)
    assert int(q.abs().max()) == 32767 and torch.equal(q.view(3, 3, 32)[1, 1], torch.zeros(32, dtype=torch.int16))
    assert bool(((_q16_dequant(x) - x).view(3, 3, 32).abs() <= d[..., None] * 0.5 * (1 + 1e-5)).all())
    with pytest.raises(RuntimeError, match="blocks of 32"):
        _ops().quantize_q16(torch.randn(2, 40))


@pytest.mark.parametrize("group", [0, 32, 64, 96, 128, 192])
def test_q8_activation_blocks_follow_the_int4_group(group):
    """quantize_q8(x, group): blocks of 64 (an int4 chunk, one scale for its two halves) where the int4
    group is a multiple of 64, else of 32 (int8 weights: group 0; int4 groups of 32 and 96); d keeps one
    scale per 32 values either way, and each value is within half a step of x; the group sums are fp32 sums."""
    x = torch.randn(2, 384, generator=torch.Generator().manual_seed(group)) * torch.tensor([1e-2, 1e2])[:, None]
    x[0, 64:128] = 0
    q, d, gs = _ops().quantize_q8(x, group)
    block = 64 if group and group % 64 == 0 else 32
    want = x.view(2, -1, block).abs().amax(-1) / 127
    torch.testing.assert_close(d, want.repeat_interleave(block // 32, dim=1))
    assert torch.equal(q[0, 64:128], torch.zeros(64, dtype=torch.int8))
    xq = (q.float().view(2, -1, 32) * d[..., None]).view(2, 384)
    assert bool(((xq - x).view(2, -1, 32).abs() <= d[..., None] * 0.5 * (1 + 1e-5)).all())
    assert gs.shape == (2, 384 // group if group else 0)
    if group:
        torch.testing.assert_close(gs, x.view(2, -1, group).sum(-1), rtol=1e-5, atol=1e-5)


def _product(w, mode: str = "f32"):
    """x [K] -> x @ W.T in fp32 for a float weight or a quant.QWeight, as the f32, q8 or q16 mode computes it.
    q8/q16: x quantized per block of 32; for int4 (q8) as _int4_reference (blocks of 64 where the group allows)."""
    from engine.moe import quant

    acts = _ACTS[mode]
    if isinstance(w, torch.Tensor):
        wf = w.float()
        return lambda x: F.linear(acts(x[None])[0], wf)
    wd = quant.dequantize(w)
    if w.precision == "int4" and mode == "q8":
        vals, n = quant._int4_values(w), w.shape[0]
        return lambda x: _int4_reference(x[None], vals, w.scales, w.group_size, n)[0]
    return lambda x: F.linear(acts(x[None])[0], wd)


def _moe_reference(h, w13, w2, ids, gates, mode="f32"):
    """Expert by expert in fp32 (weights: stacked float tensors or lists of QWeight); ``mode`` q8/q16: products
    as that mode computes them (each expert's inputs quantized per row). Returns (out, slack): slack is what
    the rounding of the down products' inputs may move each output (zero in f32), see
    :func:`_assert_q8_close`."""
    p13 = [_product(w, mode) for w in w13]
    p2 = [_product(w, mode) for w in w2]
    out, slack = torch.zeros_like(h), torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            gu = p13[e](h[t])
            inter = gu.shape[0] // 2
            act = F.silu(gu[:inter]) * gu[inter:]
            out[t] += gates[t, j] * p2[e](act)
            if mode in _LEVELS:
                slack[t] += gates[t, j].abs() * _q8_flips(act, w2[e], _LEVELS[mode])
    return out, slack


def _q8_flips(act: torch.Tensor, w, levels: int = 127) -> torch.Tensor:
    """How far the q8 (q16: ``levels`` 32767) product ``act @ W.T`` moves if the activations lying near a
    rounding boundary of their quantization round the other way: one step (the block's scale) times that input's weight column.
    The kernel computes the SiLU (an fp32 exp of its own) and the gate/up products (another summation order)
    a few ulps off PyTorch, about 1e-4 of a step, so an activation that close to x.5 steps rounds to the
    other integer there. Each such flip moves every output of the token (seen: 61 of 320 outputs 1.6e-3 of
    the largest off, from one activation 4e-6 steps from x.5). Over 12,000 tokens of random experts the
    flips came from activations at most 1e-4 steps from x.5 (int4; 2e-5 int8), so the slack counts those
    within 1e-3. A wrong scale, expert or layout moves far more."""
    from engine.moe import quant

    int4 = not isinstance(w, torch.Tensor) and w.precision == "int4"
    block = 64 if int4 and w.group_size % 64 == 0 else 32  # as the q8 mode quantizes (int4_act_block)
    blocks = act.view(-1, block)
    step = blocks.abs().amax(1, keepdim=True) / levels
    frac = (blocks / step.clamp_min(1e-30)).frac().abs()
    near = ((frac - 0.5).abs() < 1e-3).view(-1)
    if not bool(near.any()):
        return torch.zeros(w.shape[0])
    if isinstance(w, torch.Tensor):
        cols = w.float()
    elif int4:  # the reference's scale * (q - 8) term (the zero term takes the exact sums)
        cols = (quant._int4_values(w)[: w.shape[0]].float() - 8) * w.scales[:, : w.shape[0], 0].t().float(
        ).repeat_interleave(w.group_size, dim=1)
    else:
        cols = quant.dequantize(w)
    return (cols[:, near].abs() * step.expand_as(blocks).reshape(-1)[near]).sum(1)


def _assert_q8_close(got, ref, slack, rtol=1e-4, atol_of_max=1e-5):
    """q8 products against the reference: within rtol and atol_of_max of the largest output, plus the slack
    of the activations the two round differently (:func:`_q8_flips`, exact per output and token)."""
    bound = atol_of_max * float(ref.abs().max()) + rtol * ref.abs() + 1.01 * slack
    err = (got - ref).abs()
    bad = err > bound
    assert not bool(bad.any()), (f"{int(bad.sum())} of {ref.numel()} outputs off, worst {float((err - bound).max())} "
                                 f"past its bound; largest output {float(ref.abs().max())}")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("tokens", [1, 3, 4, 9, 40, 200])
def test_moe_matches_expert_by_expert_reference(dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    n_exp, hidden, inter, k = 8, 72, 40, 3  # inter and hidden not multiples of 16: tails everywhere
    h = torch.randn(tokens, hidden, generator=g)
    w13 = (torch.randn(n_exp, 2 * inter, hidden, generator=g) / 8).to(dtype)
    w2 = (torch.randn(n_exp, hidden, inter, generator=g) / 8).to(dtype)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(tokens)])
    gates = torch.rand(tokens, k, generator=g)
    ids[0, 1] = -1  # a pruned slot is skipped
    ref, _ = _moe_reference(h, w13, w2, ids, gates)
    got = kernels.moe(h, w13, w2, ids, gates)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # The same experts as a list, on the same (default) path as the stacked call; kernels.moe took the
    # path measured fastest here, which may be another variant.
    listed = _ops().moe_list(h, [w13[e] for e in range(n_exp)], [w2[e] for e in range(n_exp)], ids, gates)
    assert torch.equal(listed, _ops().moe(h, w13, w2, ids, gates, ""))


@pytest.mark.parametrize("scale", [1e-3, 30.0])
def test_moe_activation_holds_at_the_ends_of_the_exponential(scale):
    """The experts' SiLU (a vectorized exp, clamped) against PyTorch's where the gate products are tiny and
    where they reach hundreds (exp(-g) far beyond fp32's range both ways), on the f32 path of every variant
    this CPU runs."""
    g = torch.Generator().manual_seed(7)
    n_exp, hidden, inter, k, tokens = 4, 64, 48, 2, 6
    h = torch.randn(tokens, hidden, generator=g) * scale
    w13 = torch.randn(n_exp, 2 * inter, hidden, generator=g).bfloat16()
    w2 = (torch.randn(n_exp, hidden, inter, generator=g) / 8).bfloat16()
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(tokens)])
    gates = torch.rand(tokens, k, generator=g)
    ref, _ = _moe_reference(h, w13, w2, ids, gates)
    assert bool(torch.isfinite(ref).all())
    for variant in ("scalar", "avx2", "avx512"):
        if variant in _runnable():
            got = _ops().moe(h, w13, w2, ids, gates, f"{variant}:f32")
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_evict_keeps_the_values_and_refuses_what_it_cannot_flush():
    """evict flushes a tensor's lines (the calibration reads weights cold with it): the values stay, any dtype
    and size, a line's tail included; a strided view is refused."""
    import platform

    for t in (torch.arange(1000, dtype=torch.float32), torch.randn(33, 7).bfloat16(), torch.zeros(0)):
        before = t.clone()
        assert _ops().evict(t) is (platform.machine() in ("x86_64", "AMD64"))
        assert torch.equal(t, before)
    with pytest.raises(RuntimeError, match="contiguous CPU tensor"):
        _ops().evict(torch.randn(8, 8).t())


def test_moe_list_takes_missing_experts_and_refuses_routes_to_them():
    h = torch.randn(2, 32)
    w13 = torch.randn(4, 16, 32).bfloat16()
    w2 = torch.randn(4, 32, 8).bfloat16()
    ids = torch.tensor([[0, 2], [2, -1]])
    gates = torch.rand(2, 2)
    some = [w13[0], None, w13[2], None]
    some2 = [w2[0], None, w2[2], None]
    torch.testing.assert_close(_ops().moe_list(h, some, some2, ids, gates), kernels.moe(h, w13, w2, ids, gates))
    with pytest.raises(RuntimeError, match="expert 1 which has no weights"):
        _ops().moe_list(h, some, some2, torch.tensor([[1, 0], [2, 0]]), gates)


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("n", [1, 255, 256 * 64 + 3, 1_000_003, 3 * (512 << 10), 5 * (512 << 10) + 4097])
def test_stream_read_sums_every_value_once(n, ahead):
    # the rooflines' bandwidth read, both ways: each thread's half as 4 streams, or runs of 2 MiB (512 Ki
    # floats) in turn as 4 streams each; and what is left over (of the half, of a run)
    buf = torch.arange(n, dtype=torch.float32) % 7
    assert _ops().stream_read(buf, ahead) == pytest.approx(float(buf.double().sum()), rel=1e-6)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        _ops().stream_read(buf.double())
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        _ops().stream_read(torch.ones(8, 8)[:, 0])


@pytest.mark.parametrize("n_rows", [1, 5, 31, 33, 64, 129, 257, 1031, 4099])
def test_one_token_products_read_in_shared_parts_give_every_row_once_and_the_same_bits(n_rows):
    # A one-token product's runs of rows (and the MoE's down rows) are read in parts any thread may claim:
    # rows at the parts' and runs' edges are each computed, on 1-3 threads, with the bits of one thread.
    g = torch.Generator().manual_seed(n_rows)
    w, x = torch.randn(n_rows, 96, generator=g).bfloat16(), torch.randn(1, 96, generator=g)
    n_exp, hidden, inter = 6, n_rows + 40, 64  # the MoE's down rows: hidden (f32 mode: any size)
    h = torch.randn(1, hidden, generator=g)
    w13 = (torch.randn(n_exp, 2 * inter, hidden, generator=g) / 8).bfloat16()
    w2 = (torch.randn(n_exp, hidden, inter, generator=g) / 8).bfloat16()
    ids, gates = torch.tensor([[4, 0, 2]]), torch.rand(1, 3, generator=g)
    paths = ["", *(f"{v}:bf16dp" for v in ("avx512_bf16",) if v in _runnable())]
    before, outs = torch.get_num_threads(), {}
    try:
        for nt in (1, 2, 3):
            torch.set_num_threads(nt)
            for p in paths:
                outs[nt, p] = (_ops().linear_q(x, w, None, 0, 0, p, None), _ops().moe(h, w13, w2, ids, gates, ""))
    finally:
        torch.set_num_threads(before)
    moe_ref, _ = _moe_reference(h, w13, w2, ids, gates)
    for (nt, p), (y, m) in outs.items():
        xp = x.bfloat16() if p.endswith("bf16dp") else x  # bf16dp rounds the activations to bf16
        torch.testing.assert_close(y, (xp.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m, moe_ref, rtol=1e-4, atol=1e-4)  # sums of up to 4139 products
        assert torch.equal(y, outs[1, p][0]) and torch.equal(m, outs[1, p][1]), (nt, p)


def test_bad_inputs_are_refused_with_the_reason():
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        _ops().linear(x, torch.randn(4, 16).double(), None)
    with pytest.raises(RuntimeError, match="do not match"):
        _ops().linear(x, torch.randn(4, 15).bfloat16(), None)
    with pytest.raises(RuntimeError, match="float32"):
        _ops().linear(x.double(), torch.randn(4, 16).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bias"):
        _ops().linear(x, torch.randn(4, 16).bfloat16(), torch.randn(3))
    with pytest.raises(TypeError, match="activations with"):
        kernels.linear(x.bfloat16(), torch.randn(4, 16).half())
    # int8 group scales: fp32 [N, K / group], the group a multiple of 32 dividing K
    q, x64 = torch.zeros(4, 64, dtype=torch.int8), torch.randn(1, 64)
    for bad in (torch.rand(4, 2).bfloat16(), torch.rand(4, 4), torch.rand(3, 2), torch.rand(4, 3)):
        with pytest.raises(RuntimeError, match="int8 group scales must be contiguous fp32"):
            _ops().linear_q(x64, q, bad, 0, 0, "scalar:q8", None)


def test_stacked_moe_refuses_missing_or_misshapen_scales():
    from engine.moe import quant

    h, ids, gates = torch.randn(2, 64), torch.tensor([[0, 1], [1, -1]]), torch.rand(2, 2)
    q13 = [quant.quantize(torch.randn(32, 64), "int8") for _ in range(2)]
    q2 = [quant.quantize(torch.randn(64, 16), "int8") for _ in range(2)]
    w13, w2 = torch.stack([q.data for q in q13]), torch.stack([q.data for q in q2])
    s13, s2 = torch.stack([q.scales for q in q13]), torch.stack([q.scales for q in q2])
    with pytest.raises(RuntimeError, match="need their scales"):
        _ops().moe(h, w13, w2, ids, gates, "")
    with pytest.raises(RuntimeError, match="one entry per expert"):
        _ops().moe(h, w13, w2, ids, gates, "", s13[:1], s2, 0)
    with pytest.raises(RuntimeError, match="row scales"):
        _ops().moe(h, w13, w2, ids, gates, "", s13[:, :5].contiguous(), s2, 0)
    with pytest.raises(RuntimeError, match="take no scales"):
        _ops().moe(h, w13.bfloat16(), w2.bfloat16(), ids, gates, "", s13, s2, 0)
    with pytest.raises(RuntimeError, match=r"are not \[32, 48\]"):
        _ops().moe(torch.randn(2, 48), w13, w2, ids, gates, "", s13, s2, 0)


def test_norms_match_pytorch():
    from engine.model.decoder import rms_norm

    x, w, d = torch.randn(5, 100), torch.randn(100), torch.randn(5, 100)
    torch.testing.assert_close(_ops().rmsnorm(x, w, 1e-6), rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    y = x.clone()
    h = _ops().add_rmsnorm_(y, d, w, 1e-5)
    torch.testing.assert_close(y, x + d, rtol=0, atol=0)
    torch.testing.assert_close(h, rms_norm(x + d, w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("renorm", [True, False])
def test_route_matches_softmax_top_k(renorm):
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(1)) * 3
    probs = torch.softmax(logits, dim=-1)
    ref_w, ref_ids = torch.topk(probs, 8, dim=-1)
    if renorm:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    w, ids = _ops().route(logits, 8, renorm)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [0, 5])
def test_decode_attention_reads_the_cache_in_place(window):
    g = torch.Generator().manual_seed(window)
    kc, vc = torch.randn(4, 2, 32, 16, generator=g), torch.randn(4, 2, 32, 16, generator=g)
    q = torch.randn(2, 6, 16, generator=g)  # 6 query heads share 2 KV heads
    slots, lens = torch.tensor([3, 1]), torch.tensor([7, 32])
    got = _ops().decode_attention(q, kc, vc, slots, lens, window, 0.25)
    for b in range(2):
        lo = max(0, int(lens[b]) - window) if window else 0
        k = kc[slots[b], :, lo: lens[b]].repeat_interleave(3, dim=0)  # [6, n, d]
        v = vc[slots[b], :, lo: lens[b]].repeat_interleave(3, dim=0)
        ref = torch.softmax(q[b][:, None, :] @ k.transpose(1, 2) * 0.25, dim=-1) @ v  # [6, 1, d]
        torch.testing.assert_close(got[b], ref[:, 0], rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="outside the cache"):
        _ops().decode_attention(q, kc, vc, slots, torch.tensor([7, 33]), window, 0.25)


@pytest.mark.parametrize("variant", kernels.ISA_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 8, 24, 12])
def test_decode_attention_matches_softmax_at_every_head_size(variant, head_dim, dtype):
    """On every variant this CPU runs (each its own kernel or its fallback's: AVX-512 16 lanes at a time,
    AVX2 8, scalar): head sizes of 8 lanes and more (64, 128, one of 64 + 16, and 8 and 24, which leave 8
    lanes over 16) and one that is not a multiple of 8 (the scalar loop); groups of 1 to 6 query heads (the
    AVX-512 outputs take 4 heads at a time); lengths of 1, not a multiple of 8 or 16, and the whole cache;
    with and without a window."""
    if _refused(variant):
        return
    g = torch.Generator().manual_seed(head_dim)
    op = _ops()
    with kernels.on_variant(variant):
        for group in (1, 4, 6):
            for window in (0, 7):
                kc = torch.randn(3, 2, 300, head_dim, generator=g).to(dtype)
                vc = torch.randn(3, 2, 300, head_dim, generator=g).to(dtype)
                q = torch.randn(3, 2 * group, head_dim, generator=g)
                slots, lens = torch.tensor([2, 0, 1]), torch.tensor([300, 1, 13])
                got = op.decode_attention(q, kc, vc, slots, lens, window, 0.3)
                for b in range(3):
                    lo = max(0, int(lens[b]) - window) if window else 0
                    k = kc[slots[b], :, lo: lens[b]].float().repeat_interleave(group, dim=0)
                    v = vc[slots[b], :, lo: lens[b]].float().repeat_interleave(group, dim=0)
                    ref = torch.softmax(q[b][:, None, :] @ k.transpose(1, 2) * 0.3, dim=-1) @ v
                    torch.testing.assert_close(got[b], ref[:, 0], rtol=1e-5, atol=1e-5)


def _causal_reference(q, kc, vc, slot, past, window, scale):
    """PyTorch's attention of q [T, Hq, d] (positions past..) over the cache of `slot` up to each position."""
    end = past + q.shape[0]
    qpos, kpos = torch.arange(past, end)[:, None], torch.arange(end)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc[slot: slot + 1, :, :end].float(),
                                         vc[slot: slot + 1, :, :end].float(), attn_mask=mask[None, None],
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("variant", kernels.ISA_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 24, 12])
def test_prefill_attention_matches_causal_softmax(variant, head_dim, dtype):
    """A prompt's tokens against the cache up to each one's position, on every variant this CPU runs (AVX-512
    and AVX2: blocks of 16 tokens of a KV head, scores of 8 or 6 query rows x 32 keys, the outputs 32 keys at a
    time; scalar token by token as decode attends; a head size not a multiple of 8: the scalar loop): prompts
    of 1, 7, 16 and 45 tokens (a block, less, a block and a part), after 0, 5 or 70 cached positions, with
    and without a window (shorter than a block, longer than one), groups of 1, 3 and 4 query heads. The
    step's keys and values land in the cache as indexing would write them, nothing else moves."""
    if _refused(variant):
        return
    g = torch.Generator().manual_seed(head_dim)
    op = _ops()
    with kernels.on_variant(variant):
        for tokens, past, window, group in [(1, 0, 0, 1), (7, 5, 0, 3), (16, 0, 0, 4), (45, 70, 0, 4),
                                            (45, 0, 5, 3), (16, 70, 20, 1), (45, 5, 40, 4)]:
            kc = torch.randn(3, 2, 128, head_dim, generator=g).to(dtype)
            vc = torch.randn(3, 2, 128, head_dim, generator=g).to(dtype)
            q = torch.randn(tokens, 2 * group, head_dim, generator=g)
            k, v = torch.randn(tokens, 2, head_dim, generator=g), torch.randn(tokens, 2, head_dim, generator=g)
            ref_k, ref_v = kc.clone(), vc.clone()
            ref_k[1, :, past: past + tokens] = k.transpose(0, 1).to(dtype)
            ref_v[1, :, past: past + tokens] = v.transpose(0, 1).to(dtype)
            got = op.prefill_attention(q, kc, vc, 1, past, window, 0.3, k, v)
            assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
            want = _causal_reference(q, ref_k, ref_v, 1, past, window, 0.3)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{tokens} {past} {window} {group}")


def test_every_vector_variant_has_its_attention_kernels():
    """Which kernels serve attention on each compiled variant, runnable here or not, as the ops pick them (the
    variant's own, else its fallbacks'): the vector variants' decode and prompt kernels for head sizes a
    multiple of 8, none on the scalar variant or for other head sizes; the dispatch summary (what results
    record) names them."""
    want = {"scalar": "", "avx2": "avx2", "avx_vnni": "avx2"}
    with pytest.raises(RuntimeError, match="unknown ISA variant 'avx9000'"):
        kernels.attention_kernels(64, "avx9000")
    for v in kernels.variants()["compiled"]:
        serve = want.get(v, "avx512")
        assert kernels.attention_kernels(64, v) == {"decode": serve, "prompts": serve}, v
        assert kernels.attention_kernels(80, v) == {"decode": serve, "prompts": serve}, v
        assert kernels.attention_kernels(12, v) == {"decode": "", "prompts": ""}, v
    best = kernels.status()["isa"]
    assert kernels.attention_kernels() == kernels.attention_kernels(64, best)
    a = kernels.attention_kernels()
    assert kernels.dispatch_summary().endswith(f"; attention {a['decode']}, prompts {a['prompts']}")


def test_prefill_attention_refuses_what_does_not_fit():
    kc, vc = torch.zeros(2, 2, 16, 8), torch.zeros(2, 2, 16, 8)
    q, k, v = torch.randn(4, 4, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        _ops().prefill_attention(q, kc, vc, 1, 13, 0, 0.3, k, v)
    with pytest.raises(RuntimeError, match="outside the cache"):
        _ops().prefill_attention(q, kc, vc, 2, 0, 0, 0.3, k, v)
    with pytest.raises(RuntimeError, match="k and v must be contiguous float32"):
        _ops().prefill_attention(q, kc, vc, 0, 0, 0, 0.3, k[:3], v[:3])
    with pytest.raises(RuntimeError, match="caches must be"):
        _ops().prefill_attention(q, kc.half(), vc.half(), 0, 0, 0, 0.3, k, v)
    assert torch.equal(kc, torch.zeros_like(kc))  # nothing written by a refused call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_writes_the_step_rows_as_indexing_would(dtype):
    """With k and v: the step's rows land at position lens-1 of each slot (rounded to the cache's dtype as
    .to() rounds), nothing else in the caches moves, and the attention sees them."""
    g = torch.Generator().manual_seed(11)
    kc, vc = torch.randn(4, 2, 32, 16, generator=g).to(dtype), torch.randn(4, 2, 32, 16, generator=g).to(dtype)
    q, k, v = (torch.randn(3, n, 16, generator=g) for n in (4, 2, 2))
    slots, lens = torch.tensor([2, 0, 3]), torch.tensor([5, 32, 1])
    ref_k, ref_v = kc.clone(), vc.clone()
    ref_k[slots, :, lens - 1] = k.to(dtype)
    ref_v[slots, :, lens - 1] = v.to(dtype)
    want = _ops().decode_attention(q, ref_k, ref_v, slots, lens, 0, 0.25)
    got = _ops().decode_attention(q, kc, vc, slots, lens, 0, 0.25, k, v)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="k and v must be contiguous float32"):
        _ops().decode_attention(q, kc, vc, slots, lens, 0, 0.25, k[:2], v[:2])
    with pytest.raises(RuntimeError, match="k and v come together"):
        _ops().decode_attention(q, kc, vc, slots, lens, 0, 0.25, k, None)


def test_status_names_the_isa_and_library():
    st = kernels.status()
    assert st["available"] and st["isa"] in kernels.ISA_VARIANTS
    assert os.path.exists(st["library"])


# ---------------------------------------------------------------------------------------- engine


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [100, 200, 300, 4, 5], [7] * 17]


def _prompt_logits(engine: Engine) -> list[torch.Tensor]:
    from engine.quality import prompt_logits

    return [prompt_logits(engine, p) for p in PROMPTS]


@pytest.mark.parametrize("arch,overrides", [
    ("qwen2_moe", {}),  # shared expert and its gate, qkv bias
    ("qwen3_moe", {}),  # per-head q/k norms
    ("olmoe", {"clip_qkv": 0.5}),  # q/k norms over the projection, clipping
    ("mixtral", {"sliding_window": 5}),  # decode attention over a window of the cache
])
def test_engine_on_half_weights_matches_torch_fp32(make_ckpt, arch, overrides):
    """The f32 mode (forced, whatever this CPU's table picks): the logits and greedy tokens of fp32."""
    path = make_ckpt(arch, dtype="bfloat16", seed=3, **overrides)
    base = EngineConfig().replace(compute_dtype="float32", max_batch_seqs=4)
    native = Engine(path, base.replace(cpu_kernels="native"))
    torch_ = Engine(path, base.replace(cpu_kernels="torch"))
    assert native.weight_dtype == torch.bfloat16 and native.model.native
    assert torch_.weight_dtype == torch.float32 and not torch_.model.native
    assert native.model.weight_bytes() < 0.6 * torch_.model.weight_bytes()
    with kernels.forced_paths(bf16="f32"):
        for a, b in zip(_prompt_logits(native), _prompt_logits(torch_), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
        assert native.generate(PROMPTS, 8) == torch_.generate(PROMPTS, 8)
    assert native.kernels_label.startswith("native")
    assert torch_.kernels_label == "torch (runtime.cpu_kernels=torch)"


# Logit error of a whole engine against fp32, as a fraction of the largest logit, per bf16 arithmetic mode:
# f32 differs only in summation order; bf16dp rounds every product's activations to bf16 (2^-9
# relative each; measured 1.5e-3 over the tiny checkpoints' layers on an AVX512_BF16 EPYC).
# torch:widen is PyTorch's fp32 GEMM (as f32); torch:bf16, oneDNN's bf16 products (on AMX), rounds
# activations and outputs to bf16 (as bf16dp, or a little worse).
ENGINE_LOGIT_TOL = {"f32": 1e-4, "widen": 1e-4, "bf16dp": 1e-2, "tile": 1e-2, "bf16": 1e-2}


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_engine_on_the_paths_this_cpu_picks_stays_within_their_precision(make_ckpt, arch):
    """What `auto` runs here (bf16dp where AVX512_BF16 is the fastest, else f32; every mode this CPU
    runs, forced): logits within that mode's tolerance of fp32 and the same top-1 token almost everywhere,
    and the label names the mode."""
    path = make_ckpt(arch, dtype="bfloat16", seed=4)
    base = EngineConfig().replace(compute_dtype="float32", max_batch_seqs=4)
    native, torch_ = Engine(path, base), Engine(path, base.replace(cpu_kernels="torch"))
    ref = _prompt_logits(torch_)
    auto = kernels.path("bf16", 1)
    modes = [None] + (["avx512_bf16:bf16dp"] if "avx512_bf16" in _runnable() else [])
    modes += ["amx:tile"] if "amx" in _runnable() else []
    for forced in modes:
        with kernels.forced_paths(**({"bf16": forced} if forced else {})):
            # Every path the bf16 products take at some token count (prompts run many tokens at once).
            used = {kernels.path("bf16", n) for n in (1, *kernels.TOKEN_POINTS, 4096)}
            tol = max(ENGINE_LOGIT_TOL[p.split(":")[-1]] for p in used)
            mode = kernels.path("bf16", 1).split(":")[-1]
            got = _prompt_logits(native)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=tol * float(b.abs().max()))
        same = torch.cat([(a.argmax(-1) == b.argmax(-1)) for a, b in zip(got, ref, strict=True)])
        assert same.float().mean() >= 0.95, (forced, mode)
    assert auto.split(":")[-1] in native.kernels_label or auto.startswith("torch:"), native.kernels_label


def _decode_run(engine: Engine, fuse: bool) -> tuple[list[torch.Tensor], list[list[int]], dict, list, list]:
    """Logits of every step, greedy tokens, routed counts, recorded routes and each step's statistics (the
    last step's counts per layer, distinct experts, layer calls) of 3 prompts of different lengths (prompt
    steps, then decode-only steps of 3, 2 and 1 sequences)."""
    model, logits = engine.model, []
    model.fuse_decode, model.record_routes = fuse, True
    model.stats.reset()
    forward, routes, stats = model.forward, [], []

    def record(batch, cache):
        logits.append(forward(batch, cache))
        routes.append([(r.layer, r.expert_ids.clone(), r.gate_weights.clone()) for r in model.routes])
        st = model.stats
        stats.append(({k: v.tolist() for k, v in st.last.items()}, st.distinct_experts, st.layer_calls))
        return logits[-1]

    model.forward = record
    try:
        tokens = engine.generate([PROMPTS[0], PROMPTS[1][:5], PROMPTS[0][:2]], 6)
    finally:
        model.forward = forward
    return logits, tokens, {k: v.copy() for k, v in model.stats.counts.items()}, routes, stats


@pytest.mark.parametrize("arch,overrides,knobs", [
    ("qwen2_moe", {"mlp_only_layers": [0]}, {}),  # shared expert and its gate, qkv bias, a dense layer first
    ("qwen3_moe", {}, {"kv_dtype": "bfloat16"}),  # per-head q/k norms; a bf16 cache
    ("olmoe", {"clip_qkv": 0.5}, {"hi_precision": "int8"}),  # q/k norms over the projection, clipping
    ("mixtral", {"sliding_window": 5}, {"hi_precision": "int4", "int4_group_size": 32}),
    ("qwen2_moe", {"mlp_only_layers": [0]}, {"dense_precision": "int8"}),  # int8 shared expert, bias, dense MLP
    ("qwen3_moe", {}, {"dense_precision": "int8", "hi_precision": "int8"}),  # every matrix in int8
])
def test_a_fused_decode_step_gives_the_per_op_paths_bits(make_ckpt, arch, overrides, knobs):
    """Decode-only steps run every layer in one native call (DecodeStack): the same logits to the bit, the
    same routed counts and router-trace records as the per-op path, on every family's features."""
    path = make_ckpt(arch, dtype="bfloat16", seed=7, width=32, **overrides)
    engine = Engine(path, EngineConfig().replace(compute_dtype="float32", max_batch_seqs=4, **knobs))
    per_op = _decode_run(engine, fuse=False)
    assert engine.model._stack is None
    fused = _decode_run(engine, fuse=True)
    assert engine.model._stack is not None, "the decode-only steps did not take the fused path"
    assert fused[1] == per_op[1] and len(fused[0]) == len(per_op[0])
    assert all(torch.equal(a, b) for a, b in zip(per_op[0], fused[0], strict=True))
    assert [[(layer, i.tolist(), g.tolist()) for layer, i, g in step] for step in per_op[3]] == \
        [[(layer, i.tolist(), g.tolist()) for layer, i, g in step] for step in fused[3]]
    assert sorted(fused[2]) == list(engine.spec.moe_layers)
    assert all(np.array_equal(per_op[2][k], fused[2][k]) for k in fused[2])
    assert fused[4] == per_op[4]  # the step's own counts: each step's last counts, distinct experts, calls


def test_the_fused_decode_step_follows_a_change_of_path_between_steps(make_ckpt):
    """The fused step resolves its products and experts once per path and reuses its buffers while the step's
    token count stays: forced paths switched between runs (and runs of 3, 2 and 1 sequences) keep the per-op
    path's bits on each path."""
    path = make_ckpt("qwen3_moe", dtype="bfloat16", seed=11, width=32)
    engine = Engine(path, EngineConfig().replace(compute_dtype="float32", max_batch_seqs=4))
    modes = ["f32"] + [m for v, m in (("avx512_bf16", "avx512_bf16:bf16dp"), ("amx", "amx:tile")) if v in _runnable()]
    for forced in [None, *modes, None]:
        with kernels.forced_paths(**({"bf16": forced} if forced else {})):
            per_op, fused = _decode_run(engine, fuse=False), _decode_run(engine, fuse=True)
        assert engine.model.stats.fused_steps > 0, forced
        assert fused[1] == per_op[1], forced
        assert all(torch.equal(a, b) for a, b in zip(per_op[0], fused[0], strict=True)), forced


@pytest.mark.parametrize("arch,overrides", [("qwen2_moe", {"mlp_only_layers": [0]}), ("qwen3_moe", {})])
def test_the_fused_steps_phase_timers_count_the_timed_steps_and_change_no_bits(make_ckpt, arch, overrides):
    """DecodeStack.set_timing(True) times each fused step by phase (what decode_profile.py --phases prints):
    off by default, nothing counted; on, every timed step is counted and each phase the model has takes
    time (a shared expert and a dense MLP where the family has them), the phases' sum within the steps' wall
    time; off again, the counts clear. The timed steps keep the untimed steps' bits."""
    path = make_ckpt(arch, dtype="bfloat16", seed=13, width=32, **overrides)
    engine = Engine(path, EngineConfig().replace(compute_dtype="float32", max_batch_seqs=4))
    untimed = _decode_run(engine, fuse=True)
    stack = engine.model._stack[1]
    names, seconds, steps = stack.phase_seconds()
    assert names == ["norms", "qkv", "rope", "attention", "wo", "router", "routing", "experts", "shared", "mlp"]
    assert steps == 0 and seconds == [0.0] * len(names)
    stack.set_timing(True)
    t = time.perf_counter()
    timed = _decode_run(engine, fuse=True)
    wall_s = time.perf_counter() - t
    names, seconds, steps = stack.phase_seconds()
    assert steps == engine.model.stats.fused_steps > 0  # _decode_run counts its own steps
    has = {"shared": engine.model.layers[-1].shared_w13 is not None,
           "mlp": any(lw.router is None for lw in engine.model.layers)}
    for name, sec in zip(names, seconds, strict=True):
        assert (sec > 0) == has.get(name, True), (name, sec)
    assert 0 < sum(seconds) < wall_s
    assert timed[1] == untimed[1]
    assert all(torch.equal(a, b) for a, b in zip(untimed[0], timed[0], strict=True))
    stack.set_timing(False)
    assert stack.phase_seconds()[2] == 0 and sum(stack.phase_seconds()[1]) == 0.0


@pytest.mark.parametrize("torch_from", [1, 2, 3, 33])
def test_routers_take_pytorchs_gemm_from_the_measured_token_count_in_both_paths(make_ckpt, torch_from):
    """Routers' fp32 products run natively below the measured crossover and on PyTorch's GEMM from it: the
    per-op path's routes are the native op's below it and PyTorch's from it, bit for bit; the fused step is
    handed the same count and keeps the per-op path's bits (runs of 3, 2 and 1 sequences)."""
    path = make_ckpt("qwen3_moe", dtype="bfloat16", seed=12, width=32)
    engine = Engine(path, EngineConfig().replace(compute_dtype="float32", max_batch_seqs=4))
    model = engine.model
    model._router_from, model._stack = torch_from, None
    lw = next(lw for lw in model.layers if lw.router is not None)
    k = engine.spec.top_k
    for t in (1, 2, 3, 4):
        h = torch.randn(t, engine.spec.hidden_size, generator=torch.Generator().manual_seed(t))
        if t < torch_from:
            want = _ops().route(_ops().linear(h, lw.router, None), k, engine.spec.norm_topk_prob)
        else:
            want = torch.topk(torch.softmax(F.linear(h, lw.router), dim=-1, dtype=torch.float32), k, dim=-1)
            if engine.spec.norm_topk_prob:
                want = (want[0] / want[0].sum(dim=-1, keepdim=True), want[1])
        got = model._route_model(lw, h)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), t
    per_op, fused = _decode_run(engine, fuse=False), _decode_run(engine, fuse=True)
    assert model.stats.fused_steps > 0 and model._stack[1].router_torch_from() == torch_from
    assert fused[1] == per_op[1]
    assert all(torch.equal(a, b) for a, b in zip(per_op[0], fused[0], strict=True))


def test_the_routers_crossover_is_measured_and_kept(tmp_path, monkeypatch):
    from engine import calibrate

    _ops()  # the kernels loaded from the usual cache before it moves
    monkeypatch.setenv("MOETUNE_CACHE", str(tmp_path))
    got = calibrate.router_torch_tokens(16, 256)
    assert got in (*calibrate.ROUTER_TOKEN_POINTS, calibrate.ROUTER_TOKEN_POINTS[-1] + 1)
    kept = json.loads((tmp_path / "calibration.json").read_text())
    assert [v for k, v in kept.items() if k.endswith("router_torch_tokens:16x256")] == [got]
    x, w = torch.randn(4, 256), torch.randn(16, 256)
    for native in (True, False):
        seconds = _ops().time_router(x, w, native, 3)
        assert seconds.shape == (3,) and bool((seconds > 0).all()) and bool((seconds < 1).all())
    with pytest.raises(RuntimeError, match="time_router: w must be"):
        _ops().time_router(x, torch.randn(16, 128), True, 1)


def test_int8_dense_matrices_halve_the_bytes_a_step_reads_and_keep_the_tokens(make_ckpt):
    """runtime.dense_precision=int8: attention, the dense and shared MLPs and the lm head run on int8 copies
    (a scale per 32 weights of a row) on the native kernels; the roofline counts their bytes; switching back and forth
    reuses the copies; where the kernels do not run, a one-line error naming the knob, the engine unchanged."""
    from engine.quality import prompt_logits
    from engine.roofline import model_bytes

    path = make_ckpt("qwen2_moe", dtype="bfloat16", seed=3, width=32, mlp_only_layers=[0])
    engine = Engine(path, EngineConfig().replace(compute_dtype="float32"))
    ref = engine.generate([PROMPTS[0], PROMPTS[1]], 6)
    bf16_bytes = model_bytes(engine)["dense_bytes"]
    engine.reconfigure(engine.config.replace(dense_precision="int8"))
    model = engine.model
    assert model.dense_precision == "int8" and model.lm_head_int8[0].dtype == torch.int8
    lw0, lw1 = model.layers[0], model.layers[1]
    assert set(lw0.int8) == {"wqkv", "wo", "mlp_w13", "mlp_w2"} and {"shared_w13", "shared_w2"} <= set(lw1.int8)
    # The int8 copies dequantize to within half a step of their group's scale of the bf16 weights.
    q, sc = lw1.int8["wqkv"]
    n, k = q.shape
    assert sc.dtype == torch.float32 and sc.shape == (n, k // DENSE_INT8_GROUP)
    step = sc.repeat_interleave(DENSE_INT8_GROUP, dim=1)
    err = (q.float() * step - lw1.wqkv.float()).abs()
    assert bool((err <= step * 0.51 + 1e-6).all())
    # the mode that applies group scales per block runs them, and results record it
    from engine.roofline import step_cost

    assert model.int8_grouped and kernels.int8_path(1, grouped=True).endswith(  # q16 applies group scales too
        ":q16" if kernels.native_path("int8", 1).endswith(":q16") else ":q8")
    assert step_cost(engine, 1, 1.0, 8.0).dense_path == f"int8/{kernels.int8_path(1, grouped=True)}"
    int8_bytes = model_bytes(engine)["dense_bytes"]
    assert 0.45 < int8_bytes / bf16_bytes < 0.7  # int8 matrices plus their scales; norms and routers as loaded
    out = engine.generate([PROMPTS[0], PROMPTS[1]], 6)
    # Teacher-forced logits at every prompt position: the int8 model's stay close to the bf16 one's (a random
    # tiny model's near ties make generated tokens a poor measure).
    lq = prompt_logits(engine, PROMPTS[0])
    engine.reconfigure(engine.config.replace(dense_precision="as_loaded"))
    lb = prompt_logits(engine, PROMPTS[0])
    cos = F.cosine_similarity(lq, lb, dim=-1)
    assert bool((cos > 0.995).all()), cos
    assert not torch.equal(lq, lb)  # the int8 copies did run
    copies = lw1.int8["wqkv"][0]
    engine.reconfigure(engine.config.replace(dense_precision="as_loaded"))
    assert engine.generate([PROMPTS[0], PROMPTS[1]], 6) == ref
    engine.reconfigure(engine.config.replace(dense_precision="int8"))
    assert engine.model.layers[1].int8["wqkv"][0] is copies and engine.generate([PROMPTS[0], PROMPTS[1]], 6) == out
    with pytest.raises(ConfigError, match=r"runtime.dense_precision='int8' with runtime.cpu_kernels='torch'"):
        EngineConfig().replace(dense_precision="int8", cpu_kernels="torch").validate()
    # fp32 weights: PyTorch's products, no native kernels to run int8 on; the engine keeps its config.
    fp32 = Engine(make_ckpt("qwen3_moe", dtype="float32", seed=3, width=32), EngineConfig())
    assert not fp32.model.native
    before = fp32.config
    with pytest.raises(ConfigError, match=r"^runtime.dense_precision='int8': int8 dense matrices run on the native"):
        fp32.reconfigure(before.replace(dense_precision="int8"))
    assert fp32.config is before and fp32.model.dense_precision == "as_loaded" and fp32.generate([PROMPTS[0]], 2)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_the_spec_counts_the_int8_dense_copies_the_engine_makes(make_ckpt, arch, native_kernels):
    """ModelSpec.int8_dense_bytes (what the simulator adds to a config's memory) is what the engine holds."""
    e = Engine(make_ckpt(arch, dtype="bfloat16"), EngineConfig().replace(dense_precision="int8"))
    m = e.model
    held = sum(t.numel() * t.element_size() for lw in m.layers for pair in lw.int8.values() for t in pair)
    held += sum(t.numel() * t.element_size() for t in m.lm_head_int8)
    assert e.spec.int8_dense_bytes() == held


def test_decode_steps_the_fused_path_cannot_run_take_the_per_op_path(make_ckpt):
    """Routing overrides (pruned in Python) and plans that need the hybrid executor (static residency) run
    op by op; switching back to a plain config fuses again, on the new executor's experts."""
    path = make_ckpt("qwen3_moe", dtype="bfloat16", seed=7, width=32)
    engine = Engine(path, EngineConfig().replace(compute_dtype="float32", top_k_override=1))
    engine.generate([PROMPTS[0]], 3)
    assert engine.model._stack is None
    engine.reconfigure(engine.config.replace(top_k_override=0, residency="static", resident_budget_gib=0.0001))
    engine.generate([PROMPTS[0]], 3)
    assert engine.model._stack is None
    engine.reconfigure(engine.config.replace(residency="all", hi_precision="int8"))
    engine.generate([PROMPTS[0]], 3)
    assert engine.model._stack is not None and engine.model._stack[2] == "int8"
    assert engine.model._stack[3] is engine.model.hybrid.stacked


@pytest.mark.parametrize("bf16_path", ["torch:widen", "f32"])
def test_long_prompt_chunks_on_either_side_of_the_crossover(make_ckpt, bf16_path):
    """Where PyTorch's GEMM is the faster path, experts run one by one on it (widened weights); where
    the native one is, in one fused call: the same logits as PyTorch in fp32 either way."""
    from engine.quality import prompt_logits

    path = make_ckpt("qwen3_moe", dtype="bfloat16", seed=6, experts=4, top_k=2)
    base = EngineConfig().replace(compute_dtype="float32")
    native, torch_ = Engine(path, base), Engine(path, base.replace(cpu_kernels="torch"))
    prompt = [(i * 7919) % native.spec.vocab_size for i in range(200)]  # 100 tokens per expert
    with kernels.forced_paths(bf16=bf16_path):
        assert kernels.fused_moe(torch.bfloat16, 100) == (bf16_path == "f32")
        a = prompt_logits(native, prompt)
    b = prompt_logits(torch_, prompt)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))


def test_hybrid_paths_read_half_weights_natively(make_ckpt):
    path = make_ckpt("qwen3_moe", dtype="bfloat16", seed=5, experts=16, top_k=4)
    base = EngineConfig().replace(compute_dtype="float32", max_batch_seqs=4)
    plain = Engine(path, base).generate(PROMPTS, 6)
    for knobs in (dict(residency="static", resident_budget_gib=1e-4), dict(expert_batching="micro",
                                                                          micro_batch_tokens=2)):
        eng = Engine(path, base.replace(**knobs))
        assert eng.model.hybrid is not None and eng.model.hybrid.native
        assert eng.generate(PROMPTS, 6) == plain, knobs


ENGINE_CLI = [sys.executable, "-c", "import sys; from engine.cli import main; sys.exit(main())"]


def _generate(path, env, *flags):
    args = ["generate", "--model", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
            "--compute-dtype", "float32", *flags]
    return subprocess.run([*ENGINE_CLI, *args], env=env, capture_output=True, text=True, timeout=300)


def test_without_a_compiler_native_is_a_one_line_error_and_auto_says_it_falls_back(make_ckpt, tmp_path):
    path = make_ckpt("olmoe", dtype="bfloat16")
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(PATH="/nonexistent", MOETUNE_CACHE=str(tmp_path))  # no c++, g++ or clang++ to be found
    bad = _generate(path, env, "--cpu-kernels", "native")
    assert bad.returncode == 2, bad.stderr
    assert "runtime.cpu_kernels='native'" in bad.stderr and "no C++ compiler" in bad.stderr
    assert "Traceback" not in bad.stderr
    ok = _generate(path, env, "--json")
    assert ok.returncode == 0, ok.stderr
    assert "native CPU kernels are unavailable" in ok.stderr
    import json

    result = json.loads(ok.stdout.strip().splitlines()[-1])
    assert result["cpu_kernels"].startswith("torch (no native kernels: no C++ compiler")


def test_a_compiler_that_fails_is_an_error_not_a_fallback(make_ckpt, tmp_path):
    path = make_ckpt("olmoe", dtype="bfloat16")
    env = {**os.environ, "CXX": "/bin/false", "MOETUNE_CACHE": str(tmp_path)}
    bad = _generate(path, env)
    assert bad.returncode == 2, bad.stderr
    line = bad.stderr.strip().splitlines()[-1]
    assert "runtime.cpu_kernels='auto'" in line and "/bin/false" in line and "--cpu-kernels torch" in line
    assert "Traceback" not in bad.stderr
    assert _generate(path, env, "--cpu-kernels", "torch").returncode == 0  # the explicit way out works


def test_an_interrupted_build_stops_the_compilers_children(tmp_path):
    """Ctrl-C (or a test's timeout) during the first build leaves no compiler process running."""
    child_pid = tmp_path / "child.pid"
    cxx = tmp_path / "slow-c++"
    cxx.write_text("#!/bin/sh\n"
                   'if [ "$1" = --version ]; then echo slow-c++ 1.0; exit 0; fi\n'
                   f"sleep 300 & echo $! > {child_pid}\nwait\n")
    cxx.chmod(0o755)
    env = {**os.environ, "CXX": str(cxx), "MOETUNE_CACHE": str(tmp_path / "cache")}
    # stderr to a file: a pipe nobody reads until the end could fill and hold the interrupted process.
    # SIGINT at its default: a shell's background job ignores it, and Python then never raises on it.
    err = open(tmp_path / "stderr.txt", "w")  # noqa: SIM115 - closed below, after the process is gone
    proc = subprocess.Popen([sys.executable, "-c", "from engine import kernels; kernels.load()"], env=env,
                            stderr=err, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not (child_pid.exists() and child_pid.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, "the build did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) != 0, (tmp_path / "stderr.txt").read_text()[-2000:]
    finally:
        proc.kill()
        err.close()
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the compiler's child outlived the interrupted build"
    assert not list((tmp_path / "cache" / "kernels").rglob("*.so")), "a half-built library was left in the cache"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper is gone for our purpose
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("tokens", [1, 3, 4, 9])
def test_int8_linear_matches_the_dequantized_weight(tokens):
    from engine.moe import quant

    g = torch.Generator().manual_seed(tokens)
    w = torch.randn(37, 100, generator=g)  # 100 % 32 != 0: the q8 mode falls back to f32 for it
    qw = quant.quantize(w, "int8")
    x = torch.randn(tokens, 100, generator=g)
    ref = F.linear(x, quant.dequantize(qw))
    torch.testing.assert_close(kernels.linear_int8(x, qw.data, qw.scales), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(_ops().linear_int8(x, qw.data, qw.scales), ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="int8"):
        _ops().linear_int8(x, qw.data.float(), qw.scales)


@pytest.mark.parametrize("precision,group,width", [("int8", 0, 32), ("int4", 32, 32), ("int4", 64, 64)])
def test_quantized_experts_run_on_the_native_kernels(make_ckpt, precision, group, width):
    """int8 and int4 experts: one fused native call per layer, against the expert-by-expert reference on
    the dequantized weights (f32 mode: exact up to fp32 rounding; q8: with the quantized activations)."""
    from engine.quality import evaluate

    path = make_ckpt("qwen3_moe", dtype="bfloat16", seed=5, experts=16, top_k=4, width=width)  # hidden 64
    knobs = {"hi_precision": precision} | ({"int4_group_size": group} if group else {})
    eng = Engine(path, EngineConfig().replace(compute_dtype="float32", **knobs))
    hybrid = eng.model.hybrid
    assert hybrid.native and hybrid.hi == precision
    layer = eng.spec.moe_layers[0]
    v = hybrid.handles[layer][0].fast
    assert v.w13.layout == ("int8_rows" if precision == "int8" else "int4_native")
    w13 = [hd.fast.w13 for hd in hybrid.handles[layer]]
    w2 = [hd.fast.w2 for hd in hybrid.handles[layer]]
    # seeded: drawn from the global generator, the inputs changed with what earlier tests had drawn (which
    # depends on the calibration cache); seed 3 flips one activation's rounding at int4 group 64 (_q8_flips)
    h = torch.randn(5, eng.spec.hidden_size, generator=torch.Generator().manual_seed(3))
    gates, ids = eng.model.route(eng.model.layers[layer], h)
    modes = ["f32", "q16", "q8"] if precision == "int8" else ["q8"]
    for mode in modes:
        with kernels.forced_paths(**{precision: mode}):
            calls = hybrid.stats.expert_calls_fast_hi
            fused = hybrid._run_fused(layer, h, gates, ids)
            assert fused is not None and hybrid.stats.expert_calls_fast_hi == calls + len(set(ids.flatten().tolist()))
            ref, slack = _moe_reference(h, w13, w2, ids, gates, mode)
            if mode in _LEVELS:
                _assert_q8_close(fused, ref, slack, atol_of_max=1e-4)
            else:
                torch.testing.assert_close(fused, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
            x = torch.randn(2, eng.spec.hidden_size)
            ref13 = torch.stack([_product(v.w13, mode)(row) for row in x])
            torch.testing.assert_close(v.linear13(x, native=True), ref13, rtol=1e-5, atol=1e-5)
    # Trivial plans: each layer's experts stacked, the handles' versions views into the stack (one copy in
    # memory), one stacked call a layer that gives the list call's bits; a reconfigure reuses the stack.
    st = hybrid._stacked[layer]
    assert sorted(hybrid._stacked) == list(eng.spec.moe_layers) and st.precision == precision
    assert v.w13.data.data_ptr() == st.w13.data_ptr() and v.w2.scales.data_ptr() == st.s2.data_ptr()
    assert torch.equal(hybrid.forward(layer, h, gates, ids), hybrid._run_fused(layer, h, gates, ids))
    eng.reconfigure(eng.config.replace(max_batch_seqs=3))
    assert eng.model.hybrid._stacked[layer].w13.data_ptr() == st.w13.data_ptr()
    res = evaluate(eng, [list(range(3, 40))])
    assert res["top1_agreement"] > 0.9


# ---------------------------------------------------------------------------------------- ISA variants
X86 = platform.machine() in ("x86_64", "AMD64")
# [rows, inner]: tails of rows, lanes and tiles; at one token the rows of a chunk are read as 4 streams,
# and 1001 rows make several chunks, each with rows left over; bf16 at 1-2 tokens reads inner sizes of whole
# blocks of 32 from split activations (one block, an odd count, many), the others as given
F32_SHAPES = [(37, 100), (64, 1024), (5, 16), (3, 7), (1001, 64), (9, 32), (6, 96)]
# q8/int4 read blocks of 32; 160: a 128-step loop and its tail; 480: int4 groups of 96 and 160, which end
# in the middle of a 64-value chunk
Q8_SHAPES = [(37, 128), (64, 1024), (5, 96), (1, 32), (7, 160), (1001, 96), (7, 480)]
TOKENS = [1, 2, 3, 5, 9, 70]  # around the 2-4 token register tiles, and past the 64-token block


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=2e-6 * float(ref.abs().max()) + 1e-6)


def _int4(rows: int, inner: int, group: int, g: torch.Generator):
    """(native packed data, bf16 (scale, zero) [G, rows_pad, 2], values [rows_pad, inner]) of random int4."""
    from engine.moe.quant import _pack_native

    pad = (rows + 15) // 16 * 16
    vals = torch.randint(0, 16, (pad, inner), generator=g, dtype=torch.uint8)
    sz = (torch.randn(inner // group, pad, 2, generator=g) / 8).bfloat16()
    return _pack_native(vals), sz, vals


def _int4_reference(x: torch.Tensor, vals: torch.Tensor, sz: torch.Tensor, group: int, rows: int) -> torch.Tensor:
    """w = (q - 8) * scale + zero per group: scale * sum((q - 8) * x_q8) + zero * sum(x), x_q8 the
    activations as the q8 mode quantizes them against int4 weights of this group (``quantize_q8(x, group)``)."""
    t, k = x.shape
    s, z = sz[:, :rows, 0].t().float(), sz[:, :rows, 1].t().float()  # [rows, G]
    q = vals[:rows].float().view(rows, k // group, group)
    qx, d, _ = _ops().quantize_q8(x.contiguous(), group)
    xq = (qx.float().view(t, k // 32, 32) * d[:, :, None]).view(t, k // group, group)
    return (torch.einsum("tgk,ngk,ng->tn", xq, q - 8, s)
            + torch.einsum("tg,ng->tn", x.view(t, k // group, group).sum(-1), z))


@pytest.mark.parametrize("variant", kernels.ISA_VARIANTS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_every_variant_matches_pytorch_where_the_cpu_runs_it(variant, tokens):
    if _refused(variant):
        return
    op = _ops()
    g = torch.Generator().manual_seed(tokens)
    for rows, inner in F32_SHAPES:
        x = torch.randn(tokens, inner, generator=g)
        w = torch.randn(rows, inner, generator=g)
        for dt in HALF:
            _close(op.linear_q(x, w.to(dt), None, 0, 0, f"{variant}:f32", None), x @ w.to(dt).float().t())
        q = torch.randint(-127, 128, (rows, inner), dtype=torch.int8, generator=g)
        s = torch.rand(rows, generator=g).bfloat16()
        _close(op.linear_q(x, q, s, 0, 0, f"{variant}:f32", None), x @ (q.float() * s.float()[:, None]).t())
    for rows, inner in Q8_SHAPES:
        x = torch.randn(tokens, inner, generator=g)
        if variant in ("avx512_bf16", "amx"):  # their own paths are bf16dp and tile; int8 is avx512_vnni's
            wb = torch.randn(rows, inner, generator=g).bfloat16()
            mode = "bf16dp" if variant == "avx512_bf16" else "tile"
            _close(op.linear_q(x, wb, None, 0, 0, f"{variant}:{mode}", None), x.bfloat16().float() @ wb.float().t())
            continue
        q = torch.randint(-127, 128, (rows, inner), dtype=torch.int8, generator=g)
        s = torch.rand(rows, generator=g)  # fp32 row scales are accepted too
        _close(op.linear_q(x, q, s, 0, 0, f"{variant}:q8", None), _q8_dequant(x) @ (q.float() * s[:, None]).t())
        _close(op.linear_q(x, q, s, 0, 0, f"{variant}:q16", None), _q16_dequant(x) @ (q.float() * s[:, None]).t())
        # a scale per group of a row (runtime.dense_precision=int8): powers of two take the q8 mode's scales per
        # block, others (96) and the f32 mode go group by group
        for group in (32, 64, 96, 128):
            if inner % group == 0:
                sg = torch.rand(rows, inner // group, generator=g)
                w = (q.float().view(rows, -1, group) * sg[..., None]).view(rows, inner)
                _close(op.linear_q(x, q, sg, 0, 0, f"{variant}:q8", None), _q8_dequant(x) @ w.t())
                _close(op.linear_q(x, q, sg, 0, 0, f"{variant}:q16", None), _q16_dequant(x) @ w.t())
                _close(op.linear_q(x, q, sg, 0, 0, f"{variant}:f32", None), x @ w.t())
        for group in (32, 64, 96, 128, 160):
            if inner % group == 0:
                data, sz, vals = _int4(rows, inner, group, g)
                _close(op.linear_q(x, data, sz, group, rows, f"{variant}:q8", None),
                       _int4_reference(x, vals, sz, group, rows))


@pytest.mark.parametrize("tokens", [16, 17, 32, 33, 64, 100])
def test_tiles_past_16_tokens_match_pytorch(tokens):
    """The tile path past one token group (16 tokens): two groups a block, a group's tail, several blocks of
    tokens (64, 100), each with blocks of 32 and 16 rows and the rows left over, at inner sizes up to 4096."""
    if _refused("amx"):
        return
    op = _ops()
    g = torch.Generator().manual_seed(tokens)
    for rows, inner in [(1000, 1024), (48, 4096), (17, 384), (1536, 1056), (100, 1024)]:
        x = torch.randn(tokens, inner, generator=g)
        w = torch.randn(rows, inner, generator=g).bfloat16()
        _close(op.linear_q(x, w, None, 0, 0, "amx:tile", None), x.bfloat16().float() @ w.float().t())


# Every (variant, format, mode) there is: f32 on each, q8 and q16 on those with int8 products (avx512_bf16's
# are avx512_vnni's; the VNNI variants' q16 is avx2's or avx512's), bf16dp on avx512_bf16 alone.
INT_VARIANTS = [v for v in kernels.ISA_VARIANTS if v not in ("avx512_bf16", "amx")]
MOE_PATHS = ([(v, f, "f32") for v in kernels.ISA_VARIANTS for f in ("bf16", "fp16", "int8")]
             + [(v, f, "q8") for v in INT_VARIANTS for f in ("int8", "int4")] + [(v, "int8", "q16") for v in INT_VARIANTS] + [("avx512_bf16", "bf16", "bf16dp"), ("amx", "bf16", "tile")])


@pytest.mark.parametrize("variant,fmt,mode", MOE_PATHS)
@pytest.mark.parametrize("tokens", [300, 70, 40, 23, 2, 1])
def test_moe_on_every_variant_and_path_the_cpu_runs(variant, fmt, mode, tokens):
    """Many experts, some unrouted (None), a skipped slot, uneven tokens per expert. Up to 64 tokens an
    expert the work is split in runs of one expert's rows (moe_spans): at 1, 2 and 23 tokens one run an
    expert and phase; at 40 every token also routes to expert 0, whose runs are split to balance the
    threads; at 70 expert 0 has more tokens than a token block, and the vector kinds' items are short blocks
    of rows (tiles still take runs, up to 256 tokens an expert); at 300 the tiles' items are short blocks too,
    4 to a thread at a time, each prefetching the next one's rows. An expert with one token reads its rows as
    several streams."""
    if _refused(variant):
        return
    from engine.moe import quant

    g = torch.Generator().manual_seed(len(variant) + len(fmt))
    n_exp, hidden, inter, k, group = 32, 96, 64, 4, 32
    h = torch.randn(tokens, hidden, generator=g)
    if tokens >= 40:  # slot 0 of every token: expert 0; the other slots: experts 1..27
        ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(n_exp - 5, generator=g)[:k - 1]])
                           for _ in range(tokens)])
    else:
        ids = torch.stack([torch.randperm(n_exp - 4, generator=g)[:k] for _ in range(tokens)])  # experts 28..31 unused
    ids[0, 1] = -1
    gates = torch.rand(tokens, k, generator=g)
    f13 = [torch.randn(2 * inter, hidden, generator=g) / 8 for _ in range(n_exp)]
    f2 = [torch.randn(hidden, inter, generator=g) / 8 for _ in range(n_exp)]
    if fmt in ("bf16", "fp16"):
        dt = torch.bfloat16 if fmt == "bf16" else torch.float16
        w13, w2 = [w.to(dt) for w in f13], [w.to(dt) for w in f2]
        d13, d2, s13, s2 = w13, w2, [], []
        r13, r2 = w13, w2
    else:
        q13 = [quant.quantize(w, fmt, group, native=True) for w in f13]
        q2 = [quant.quantize(w, fmt, group, native=True) for w in f2]
        d13, d2 = [q.data for q in q13], [q.data for q in q2]
        s13, s2 = [q.scales for q in q13], [q.scales for q in q2]
        r13, r2 = q13, q2
    unused = set(range(n_exp - 4, n_exp))
    drop = [None if e in unused else w for e, w in enumerate(d13)], [None if e in unused else w for e, w in enumerate(d2)]
    got = _ops().moe_q(h, drop[0], s13, drop[1], s2, ids, gates, group, f"{variant}:{mode}")
    # The same experts stacked (one tensor per weight and scale, as trivial plans run int8/int4 experts) give
    # the same bits: the experts no token routes to are never read.
    stacked = (torch.stack(d13), torch.stack(d2)) + ((torch.stack(s13), torch.stack(s2)) if s13 else (None, None))
    assert torch.equal(_ops().moe(h, stacked[0], stacked[1], ids, gates, f"{variant}:{mode}", stacked[2], stacked[3],
                                  group if fmt == "int4" else 0), got)
    if mode in ("bf16dp", "tile"):
        ref, _ = _moe_reference(h.bfloat16().float(), r13, r2, ids, gates)  # bf16dp rounds act too: loose
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
        return
    ref, slack = _moe_reference(h, r13, r2, ids, gates, mode)
    if mode in _LEVELS:
        _assert_q8_close(got, ref, slack)
    else:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("tokens", [23, 70, 300])
def test_moe_on_tiles_splits_the_down_rows_among_threads_or_keeps_each_slot_apart(tokens):
    """Tile mode's phase 1 writes the activations from the tiles of a block of 32 gate rows and the same 32
    up rows, packed as phase 2's B tiles; phase 2 gives each thread a part of the output rows where every thread gets at least 128 (hidden 288 on 1 or 2
    threads: parts of 288 rows, or of 128 and a last of 32), else keeps each slot's product apart (3
    threads: 96 rows each). Every thread count gives the reference; phase 2's parts sum each output in
    expert order, so 1 and 2 threads agree bit for bit."""
    if _refused("amx"):
        return
    g = torch.Generator().manual_seed(tokens)
    n_exp, hidden, inter, k = 16, 288, 96, 4
    h = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(tokens)])
    ids[: tokens // 2, 0] = 3  # one expert of many tokens: two token groups and more
    ids[0, 1] = -1
    gates = torch.rand(tokens, k, generator=g)
    w13 = (torch.randn(n_exp, 2 * inter, hidden, generator=g) / 8).bfloat16()
    w2 = (torch.randn(n_exp, hidden, inter, generator=g) / 8).bfloat16()
    before, outs = torch.get_num_threads(), {}
    try:
        for nt in (1, 2, 3):
            torch.set_num_threads(nt)
            outs[nt] = _ops().moe(h, w13, w2, ids, gates, "amx:tile")
    finally:
        torch.set_num_threads(before)
    ref, _ = _moe_reference(h.bfloat16().float(), w13, w2, ids, gates)  # the tiles round act to bf16 too
    for nt, got in outs.items():
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=1e-2 * float(ref.abs().max()), msg=f"{nt} threads")
    assert torch.equal(outs[1], outs[2])
    torch.testing.assert_close(outs[3], outs[1], rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_variants_follow_cpuid():
    v = kernels.variants()
    assert v["compiled"] == (list(kernels.ISA_VARIANTS) if X86 else ["scalar"])
    assert "scalar" in v["runnable"] and set(v["runnable"]) <= set(v["compiled"])
    assert kernels.status()["isa"] == v["runnable"][-1]  # the most preferred variant this CPU runs
    flags, feats = set(kernels._cpu_flags().split()), set(kernels.cpu_features())
    for name in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
                 "avx_vnni", "amx_tile", "amx_bf16", "amx_int8"):
        assert (name in feats) == (name in flags), name
    assert ("avx2" in v["runnable"]) == ({"avx2", "fma", "f16c"} <= flags)
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert ("avx512_vnni" in v["runnable"]) == (avx512 | {"avx512_vnni"} <= flags)
    assert ("avx512_bf16" in v["runnable"]) == (avx512 | {"avx512_vnni", "avx512_bf16"} <= flags)
    if "amx" in v["runnable"]:  # AMX also needs the OS's tile state (XCR0) and Linux's permission (arch_prctl)
        assert avx512 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"} <= flags
    elif sys.platform == "linux" and {"amx_tile", "amx_bf16"} <= flags and "os_amx" in feats:
        pytest.fail("the CPU and OS have AMX tiles but the amx kernels are not runnable")


def test_set_isa_switches_the_default_and_refuses_what_the_cpu_lacks():
    op = _ops()
    best = op.isa()
    x, w = torch.randn(3, 40), torch.randn(9, 40).bfloat16()
    with kernels.on_variant("scalar"):
        assert op.isa() == "scalar"
        _close(op.linear(x, w, None), x @ w.float().t())
    assert op.isa() == best
    with pytest.raises(RuntimeError, match="unknown ISA variant 'avx9000'"):
        op.set_isa("avx9000")
    for v in set(kernels.variants()["compiled"]) - set(_runnable()):
        with pytest.raises(RuntimeError, match=f"cannot run the {v} kernels"):
            op.set_isa(v)
    with pytest.raises(RuntimeError, match="has no mode 'bf16dp' for int8"):
        op.linear_q(x, torch.zeros(9, 40, dtype=torch.int8), torch.ones(9), 0, 0, ":bf16dp", None)


@pytest.mark.skipif(not X86, reason="the ISA variants are x86 code")
def test_variants_this_cpu_cannot_run_are_compiled_with_their_instructions():
    """The compile check of every variant, runnable here or not: its instructions are in the library."""
    import re

    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", kernels.status()["library"]], capture_output=True,
                         text=True, check=True).stdout
    assert "vdpbf16ps" in dis  # avx512_bf16: bf16 pair dot products
    assert re.search(r"\svpdpbusd\s+%zmm", dis)  # avx512_vnni: int8 dot products, 512-bit
    assert re.search(r"\{vex\} vpdpbusd\s+%ymm", dis)  # avx_vnni: the VEX-encoded 256-bit form
    assert re.search(r"\svpmaddubsw\s+%zmm", dis)  # avx512 without VNNI
    assert re.search(r"\svpmaddubsw\s+%ymm", dis)  # avx2
    assert re.search(r"\svfmadd\d+ps\s+%zmm", dis) and re.search(r"\svfmadd\d+ps\s+%ymm", dis)


ISA_CHECK = """
import sys, torch, torch.nn.functional as F
torch.ops.load_library(sys.argv[1])
op = torch.ops.moetune
compiled, runnable = op.variants()
g = torch.Generator().manual_seed(0)
for v in runnable:
    for dt in (torch.bfloat16, torch.float16):
        for t in (1, 3, 5):
            x, w, b = torch.randn(t, 100, generator=g), torch.randn(37, 100, generator=g).to(dt), torch.randn(37)
            torch.testing.assert_close(op.linear_q(x, w, None, 0, 0, v + ":f32", b), F.linear(x, w.float(), b),
                                       rtol=1e-5, atol=1e-4)
    q, s = torch.randint(-127, 128, (37, 128), dtype=torch.int8, generator=g), torch.rand(37)
    x = torch.randn(3, 128, generator=g)
    if v != "avx512_bf16":
        qx, d, _ = op.quantize_q8(x, 0)
        xd = (qx.float().view(3, 4, 32) * d[:, :, None]).view(3, 128)
        torch.testing.assert_close(op.linear_q(x, q, s, 0, 0, v + ":q8", None), xd @ (q.float() * s[:, None]).t(),
                                   rtol=1e-5, atol=1e-3)
kc, vc, qd = torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16), torch.randn(1, 4, 16)
out = op.decode_attention(qd, kc, vc, torch.tensor([1]), torch.tensor([40]), 0, 0.25)
kk, vv = kc[1].repeat_interleave(2, 0), vc[1].repeat_interleave(2, 0)
ref = (torch.softmax(qd[0][:, None] @ kk.transpose(1, 2) * 0.25, -1) @ vv)[:, 0]
torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)
print(op.isa(), ",".join(compiled))
"""


@pytest.mark.skipif(not X86, reason="-march=x86-64 is an x86 target")
def test_a_baseline_build_dispatches_the_same_variants(tmp_path, monkeypatch):
    """Built for the baseline x86-64 (no -march=native), the library still holds every variant and picks
    the same one from CPUID: the dispatch does not depend on the build machine's flags. Checked in its
    own process (one process can register the op namespace once)."""
    monkeypatch.setenv("MOETUNE_CACHE", str(tmp_path))
    lib = kernels._build(kernels._compiler(), march="x86-64")
    script = tmp_path / "check.py"
    script.write_text(ISA_CHECK)
    res = subprocess.run([sys.executable, str(script), str(lib)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    isa, compiled = res.stdout.split()
    assert isa == kernels.status()["isa"] and compiled.split(",") == list(kernels.ISA_VARIANTS)


@pytest.mark.skipif(not X86, reason="the prefetches are x86 instructions")
def test_the_attention_kernels_prefetches_survive_the_compiler():
    """Every prefetch loop of the decode attention kernels is in the built library: GCC deletes a loop whose
    body is only __builtin_prefetch, and did so to all but the first of attend_rows' loops until 2026-12-05
    (one prefetcht1 in each). An item's first keys and values, and each block's keys ahead: at least 3
    prefetch instructions in each variant's kernel, fp32 and bf16 caches (objdump comes with the compiler)."""
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils, installed with the C++ compiler) not found"
    dis = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", str(kernels.status()["library"])],
                         capture_output=True, text=True, check=True, timeout=600).stdout
    counts: dict[str, int] = {}
    fn = None
    for line in dis.splitlines():
        if line.endswith(">:"):
            fn = line[line.index("<") + 1:-2]
            fn = fn if "::attend_rows<" in fn and not fn.endswith("@plt") else None
            if fn:
                counts[fn] = 0
        elif fn and "prefetcht1" in line:
            counts[fn] += 1
    kernels_found = {f.split("::")[1] + ("/bf16" if "unsigned short" in f else "/fp32") for f in counts}
    assert kernels_found == {"v_avx2/fp32", "v_avx2/bf16", "v_avx512/fp32", "v_avx512/bf16"}, counts
    assert all(c >= 3 for c in counts.values()), counts


# ---------------------------------------------------------------------------------------- path table
def test_choose_paths_takes_one_mode_and_the_measured_crossover():
    pts = (1, 4, 16, 64, 256)

    def t(*v):
        return {str(p): x for p, x in zip(pts, v, strict=True)}

    times = {"int8": {"avx2:f32": t(1, 2, 8, 32, 128), "avx2:q8": t(.8, 1.5, 6, 24, 96),
                      "torch:quant": t(5, 5, 8, 20, 50)},
             "bf16": {"avx2:f32": t(1, 2, 8, 32, 128), "avx512:f32": t(.9, 2.1, 8.5, 33, 130),
                      "torch:widen": t(4, 4, 9, 30, 100)},
             "int4": {"avx2:q8": t(1, 2, 8, 32, 128), "torch:quant": t(2, 1, 4, 16, 64)}}
    tab = kernels.choose_paths(times, pts)
    assert tab["int8"]["mode"] == "q8"
    assert tab["int8"]["ranges"] == [[32, "avx2:q8"], [None, "torch:quant"]] and tab["int8"]["crossover_tokens"] == 33
    assert tab["bf16"]["ranges"] == [[2, "avx512:f32"], [32, "avx2:f32"], [None, "torch:widen"]]
    # int4: the native layout or PyTorch's, decided at one token; never mixed by token count
    assert tab["int4"]["ranges"] == [[None, "avx2:q8"]] and tab["int4"]["crossover_tokens"] is None
    times["int4"]["torch:quant"]["1"] = 0.5
    assert kernels.choose_paths(times, pts)["int4"]["ranges"] == [[None, "torch:quant"]]
    assert [kernels._lookup(tab["bf16"]["ranges"], n) for n in (1, 2, 3, 32, 33, 10**6)] == [
        "avx512:f32", "avx512:f32", "avx2:f32", "avx2:f32", "torch:widen", "torch:widen"]


def test_choose_paths_takes_vdpbf16ps_and_amx_tiles_as_one_arithmetic():
    """Both round the activations to bf16 and sum exact products in fp32: the table takes each where it is
    fastest (this AMX Xeon's calibration, 2026-12-04: tiles 27 % slower at one token, 3-4x faster from 16),
    never the f32 mode beside them."""
    pts = (1, 4, 16, 64, 256)

    def t(*v):
        return {str(p): x for p, x in zip(pts, v, strict=True)}

    times = {"bf16": {"avx512:f32": t(31.6, 42.4, 144, 573, 2110), "avx512_bf16:bf16dp": t(31.7, 44.7, 186, 699, 2443),
                      "amx:tile": t(40.2, 42.6, 62.3, 224, 614), "torch:bf16": t(149, 146, 180, 286, 484)}}
    tab = kernels.choose_paths(times, pts)["bf16"]
    assert tab["mode"] == "bf16" == kernels.arithmetic("amx:tile") == kernels.arithmetic("avx512_bf16:bf16dp")
    assert tab["ranges"] == [[2, "avx512_bf16:bf16dp"], [128, "amx:tile"], [None, "torch:bf16"]]
    assert tab["native_ranges"] == [[2, "avx512_bf16:bf16dp"], [8, "amx:tile"], [32, "amx:tile"], [128, "amx:tile"],
                                    [None, "amx:tile"]]
    # Where the f32 mode is the fastest at every count but one, it is the arithmetic, with its own variants only.
    times["bf16"]["avx512:f32"] = t(20, 30, 60, 220, 600)
    assert kernels.choose_paths(times, pts)["bf16"]["ranges"] == [[128, "avx512:f32"], [None, "torch:bf16"]]



def test_choose_paths_takes_the_arithmetic_a_precision_must_take():
    """``modes`` (experts.int8_activations=fp32): int8 takes the f32 arithmetic (fp32 activations) where q8
    is faster at every count, and no PyTorch path that rounds the activations (torch:quant); without it the
    fastest arithmetic wins as before. An arithmetic the precision has no path of is ignored (int4: q8 only)."""
    pts = (1, 4, 16, 64, 256)

    def t(*v):
        return {str(p): x for p, x in zip(pts, v, strict=True)}

    times = {"int8": {"avx512:f32": t(30, 40, 150, 600, 2400), "avx512_vnni:q8": t(25, 30, 60, 200, 800),
                      "torch:quant": t(90, 90, 100, 150, 300)},
             "int4": {"avx512_vnni:q8": t(20, 25, 50, 180, 700), "torch:quant": t(60, 60, 80, 120, 250)}}
    fastest = kernels.choose_paths(times, pts)
    assert fastest["int8"]["mode"] == "q8" and fastest["int8"]["ranges"][-1] == [None, "torch:quant"]
    exact = kernels.choose_paths(times, pts, modes={"int8": "f32", "int4": "f32"})
    assert exact["int8"]["mode"] == "f32" and exact["int8"]["ranges"] == [[None, "avx512:f32"]]
    assert exact["int8"]["crossover_tokens"] is None and exact["int4"] == fastest["int4"]
    # q16 keeps 15 bits of each activation: no path that rounds them to bf16 either, fp32 GEMM where it wins.
    times["int8"] |= {"avx2:q16": t(26, 31, 70, 230, 900), "avx512:q16": t(27, 30, 65, 220, 850),
                      "torch:widen": t(200, 200, 210, 300, 900)}
    wide = kernels.choose_paths(times, pts, modes={"int8": "q16"})["int8"]
    assert wide["mode"] == "q16" and wide["ranges"] == [[2, "avx2:q16"], [None, "avx512:q16"]]
    assert wide["crossover_tokens"] is None
    times["int8"]["torch:widen"] = t(200, 200, 210, 300, 400)
    assert kernels.choose_paths(times, pts, modes={"int8": "q16"})["int8"]["ranges"][-1] == [None, "torch:widen"]


def test_paths_are_measured_once_and_reported():
    import time

    from engine import calibrate

    first = calibrate.kernel_paths()
    t = time.perf_counter()
    assert calibrate.kernel_paths() == first and time.perf_counter() - t < 1.0  # cached
    # The cache keeps the times; the table is chosen from them by the rule of this version of the engine.
    data = calibrate._load()
    (key,) = [k for k in data if ":kernel_paths:" in k and k.startswith(calibrate._store_key())
              and data[k]["times_s"] == first["times_s"]]
    data[key]["table"] = {"bf16": "a table an older rule chose"}
    calibrate._save(data)
    assert calibrate.kernel_paths()["table"] == first["table"] == kernels.choose_paths(
        {prec: {p: ts for p, ts in by.items() if p in kernels.candidate_paths(prec, _runnable(), kernels.amx_present())}
         for prec, by in first["times_s"].items() if prec in kernels.PRECISIONS}, modes=kernels.modes())
    rep = kernels.dispatch_report()
    assert rep["available"] and rep["isa"] == kernels.status()["isa"] and rep["runnable"] == _runnable()
    for prec in kernels.PRECISIONS:
        ranges = rep["paths"][prec]["ranges"]
        assert ranges[-1][0] is None
        allowed = kernels.candidate_paths(prec, rep["runnable"], rep["amx"]["present"])
        assert all(p in allowed for _, p in ranges) and rep["peak_gflops"][prec]
    flags = set(kernels._cpu_flags().split())
    assert rep["amx"]["present"] == ({"amx_tile", "amx_bf16"} <= flags and "os_amx" in kernels.cpu_features())
    if not rep["amx"]["present"]:
        assert rep["amx"]["detail"].startswith("absent")
    # oneDNN's bf16 products compete wherever the CPU multiplies bf16 natively (AMX or AVX512_BF16), only there.
    native_bf16 = rep["amx"]["present"] or "avx512_bf16" in rep["runnable"]
    assert ("torch:bf16" in kernels.candidate_paths("bf16", rep["runnable"], rep["amx"]["present"])) == native_bf16
    assert "torch:bf16" not in kernels.candidate_paths("bf16", ["scalar", "avx2", "avx512"], False)
    assert "torch:bf16" in kernels.candidate_paths("bf16", ["scalar", "avx2", "avx512", "avx512_bf16"], False)
    # q16 uses no VNNI instruction: its variants are avx2 and avx512 (scalar where neither runs)
    vnni = ["scalar", "avx2", "avx_vnni", "avx512", "avx512_vnni"]
    assert [p for p in kernels.candidate_paths("int8", vnni) if p.endswith(":q16")] == ["avx2:q16", "avx512:q16"]
    assert "scalar:q16" in kernels.candidate_paths("int8", ["scalar"])
    # int8 takes one of the arithmetics its activations knob allows (auto: f32 or q16), and the report says which
    assert rep["paths"]["int8"]["mode"] in kernels.modes()["int8"]
    assert {kernels.arithmetic(p) for _, p in rep["paths"]["int8"]["ranges"] if not p.startswith("torch:")} == {
        rep["paths"]["int8"]["mode"]}
    assert kernels.dispatch_summary().startswith(rep["isa"] + ";")
    with kernels.forced_paths(int8="f32"):
        assert kernels.path("int8", 7) == ":f32" and "int8 :f32 (forced)" in kernels.dispatch_summary()
    assert kernels.path("int8", 7) == kernels._lookup(rep["paths"]["int8"]["ranges"], 7)


# ---------------------------------------------------------------------------------------- KV cache in bf16
def test_decode_attention_reads_a_bf16_cache():
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(3, 2, 24, 16, generator=g).bfloat16(), torch.randn(3, 2, 24, 16, generator=g).bfloat16()
    q = torch.randn(2, 4, 16, generator=g)
    slots, lens = torch.tensor([2, 0]), torch.tensor([24, 9])
    got = _ops().decode_attention(q, kc, vc, slots, lens, 0, 0.25)
    for b in range(2):
        k = kc[slots[b], :, : lens[b]].float().repeat_interleave(2, dim=0)
        v = vc[slots[b], :, : lens[b]].float().repeat_interleave(2, dim=0)
        ref = torch.softmax(q[b][:, None, :] @ k.transpose(1, 2) * 0.25, dim=-1) @ v
        torch.testing.assert_close(got[b], ref[:, 0], rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        _ops().decode_attention(q, kc.half(), vc.half(), slots, lens, 0, 0.25)


@pytest.mark.parametrize("cpu_kernels", ["auto", "torch"])
def test_bf16_kv_cache_halves_the_cache_at_a_measured_cost(make_ckpt, cpu_kernels):
    from engine.quality import evaluate

    path = make_ckpt("qwen3_moe", dtype="bfloat16", seed=3)
    base = EngineConfig().replace(compute_dtype="float32", max_batch_seqs=4, cpu_kernels=cpu_kernels)
    fp32, bf16 = Engine(path, base), Engine(path, base.replace(kv_dtype="bfloat16"))
    assert fp32.cache.dtype == torch.float32 and bf16.cache.dtype == torch.bfloat16
    assert bf16.cache.nbytes() * 2 == fp32.cache.nbytes()
    assert len(bf16.generate(PROMPTS, 6)[0]) == 6  # decode steps read the bf16 cache (native or SDPA)
    res = evaluate(bf16, PROMPTS)  # against the fp32 reference, whose KV cache is fp32
    assert res["top1_agreement"] > 0.9 and res["mean_kl"] > 0


def test_int8_activations_choose_how_int8_experts_meet_the_activations(make_ckpt):
    """experts.int8_activations: fp32 runs int8 experts on the f32 mode at every token count, int16 on the q16
    mode, int8 on the q8 mode (activations quantized per block of 32), auto (the default) on the faster
    arithmetic of f32 and q16 in the measured times; reconfigure switches the path table, the results record
    it (the dispatch summary), and the arithmetics score differently against the fp32 reference, int16 as
    close to fp32 as 15 bits a block make it."""
    from engine import calibrate
    from engine.quality import evaluate

    path = make_ckpt("qwen3_moe", dtype="bfloat16", seed=5)
    eng = Engine(path, EngineConfig().replace(compute_dtype="float32", hi_precision="int8", max_batch_seqs=2))

    def int8_paths() -> str:
        return kernels.dispatch_summary().split("; int8 ")[1].split(";")[0]

    assert eng.config.experts.int8_activations == "auto" and kernels.modes()["int8"] == ("f32", "q16")
    times = {p: t for p, t in calibrate.kernel_paths()["times_s"]["int8"].items()
             if p in kernels.candidate_paths("int8", _runnable(), kernels.amx_present())}
    faster = kernels.choose_paths({"int8": times}, modes={"int8": ("f32", "q16")})["int8"]["mode"]
    assert faster in ("f32", "q16") and kernels.prepare()["int8"]["mode"] == faster
    assert ":q8" not in int8_paths() and "torch:quant" not in int8_paths() and f":{faster}" in int8_paths()
    scores = {}
    try:
        for value, mode in (("fp32", "f32"), ("int16", "q16"), ("int8", "q8")):
            eng.reconfigure(eng.config.replace(int8_activations=value))
            assert kernels.modes()["int8"] == (mode,)
            assert all(kernels.path("int8", n).endswith(f":{mode}") for n in (1, 3, 16, 64))
            assert f":{mode}" in int8_paths() and all(f":{m}" not in int8_paths() for m in ("f32", "q16", "q8")
                                                       if m != mode)
            if mode == "f32":
                assert all(kernels.path("int8", n).endswith(":f32") for n in (1000,))
            scores[value] = evaluate(eng, PROMPTS)
    finally:
        eng.reconfigure(eng.config.replace(int8_activations="auto"))
    assert kernels.modes()["int8"] == ("f32", "q16") and kernels.prepare()["int8"]["mode"] == faster
    exact, wide, quantized = (scores[v]["mean_kl"] for v in ("fp32", "int16", "int8"))
    assert len({exact, wide, quantized}) == 3 and abs(wide - exact) < abs(quantized - exact)
    with pytest.raises(ValueError, match="int8 activations 'int4': expected one of auto, fp32, int16, int8"):
        kernels.set_int8_activations("int4")


def test_a_moe_on_tiles_runs_its_experts_of_few_tokens_on_vdpbf16ps_as_measured():
    """calibrate.moe_vector_tokens: the fused MoE timed cold on each mode, every expert at n tokens; the
    vector mode up to the first count where tiles win; kernels.moe_path names the count ("tile/N")."""
    from engine import calibrate

    n = calibrate.moe_vector_tokens()
    tiles = any(p.endswith(":tile") for _, p in kernels.prepare()["bf16"]["native_ranges"])
    if "amx" not in kernels.variants()["runnable"] or not tiles:
        assert n == 0 and not kernels.moe_path("bf16", 16, 1024, 384).count("/")
        return
    (key,) = [k for k in calibrate._load() if ":moe_vector_tokens:" in k and k.startswith(calibrate._store_key())]
    got = calibrate._load()[key]
    times = got["times_s"]
    assert set(times) == {"bf16dp", "tile"} and n == got["tokens"]
    assert all(set(ts) == {str(p) for p in calibrate._MOE_POINTS} for ts in times.values())
    below = [p for p in calibrate._MOE_POINTS if p <= n]
    assert all(times["bf16dp"][str(p)] < times["tile"][str(p)] for p in below)
    if n < calibrate._MOE_POINTS[-1]:
        nxt = calibrate._MOE_POINTS[len(below)]
        assert times["bf16dp"][str(nxt)] >= times["tile"][str(nxt)]
    tile_at = next(t for t in (3, 4, 8, 16, 32) if kernels.native_path("bf16", t).endswith(":tile"))
    assert kernels.moe_path("bf16", tile_at, 1024, 384) == kernels.native_path("bf16", tile_at) + (f"/{n}" if n else "")
    # whatever the experts' average: the dense products' crossover does not put a MoE's experts of many
    # tokens on vdpbf16ps
    assert kernels.moe_path("bf16", 1, 1024, 384) == kernels.moe_path("bf16", tile_at, 1024, 384)
    # and a MoE on tiles stays one native call where the dense products cross over to oneDNN
    assert all(kernels.fused_moe("bf16", t) for t in (1, tile_at, 512, 4096) if kernels.native_path("bf16", t).endswith(":tile"))
    assert kernels.dispatch_report()["moe_vector_tokens"] == n
    with kernels.forced_paths(bf16="amx:tile"):  # a forced path is taken as it is
        assert kernels.moe_path("bf16", tile_at, 1024, 384) == "amx:tile"
