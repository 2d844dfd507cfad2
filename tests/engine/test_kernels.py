"""The native CPU kernels (engine/kernels): fp32 products read from bf16/fp16 weights.

Each op is checked against PyTorch on the same weights widened to fp32 (the kernels' arithmetic is
an fp32 product; only the summation order differs), on shapes that hit every tile and tail: token
counts 1..9 around the 4-token register tile, rows not a multiple of 4, inner sizes not a multiple
of the 16-lane vector. Then the engine: a bf16 checkpoint run with the kernels gives the logits and
greedy tokens of the same checkpoint run with PyTorch in fp32, with half the weight bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine import kernels
from engine.config import EngineConfig
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


def test_linear_wrapper_keeps_leading_dims_and_falls_back_for_many_tokens():
    w = torch.randn(24, 48).bfloat16()
    x3 = torch.randn(2, 3, 48)
    torch.testing.assert_close(kernels.linear(x3, w), F.linear(x3, w.float()), rtol=RTOL, atol=1e-4)
    many = torch.randn(kernels.MAX_NATIVE_TOKENS + 7, 48)  # widened weight, PyTorch's GEMM
    torch.testing.assert_close(kernels.linear(many, w), F.linear(many, w.float()), rtol=RTOL, atol=1e-4)
    same = torch.randn(5, 48).bfloat16()  # same dtypes: plain F.linear
    assert torch.equal(kernels.linear(same, w), F.linear(same, w))


def _moe_reference(h, w13, w2, ids, gates):
    inter = w2.shape[2]
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            gu = F.linear(h[t], w13[e].float())
            out[t] += gates[t, j] * F.linear(F.silu(gu[:inter]) * gu[inter:], w2[e].float())
    return out


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("tokens", [1, 3, 4, 9, 40])
def test_moe_matches_expert_by_expert_reference(dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    n_exp, hidden, inter, k = 8, 72, 40, 3  # inter and hidden not multiples of 16: tails everywhere
    h = torch.randn(tokens, hidden, generator=g)
    w13 = (torch.randn(n_exp, 2 * inter, hidden, generator=g) / 8).to(dtype)
    w2 = (torch.randn(n_exp, hidden, inter, generator=g) / 8).to(dtype)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(tokens)])
    gates = torch.rand(tokens, k, generator=g)
    ids[0, 1] = -1  # a pruned slot is skipped
    ref = _moe_reference(h, w13, w2, ids, gates)
    got = kernels.moe(h, w13, w2, ids, gates)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    listed = _ops().moe_list(h, [w13[e] for e in range(n_exp)], [w2[e] for e in range(n_exp)], ids, gates)
    assert torch.equal(listed, got)


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


def test_status_names_the_isa_and_library():
    st = kernels.status()
    assert st["available"] and st["isa"] in ("avx512", "avx2", "scalar")
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
    path = make_ckpt(arch, dtype="bfloat16", seed=3, **overrides)
    base = EngineConfig().replace(compute_dtype="float32", max_batch_seqs=4)
    native = Engine(path, base.replace(cpu_kernels="native"))
    torch_ = Engine(path, base.replace(cpu_kernels="torch"))
    assert native.weight_dtype == torch.bfloat16 and native.model.native
    assert torch_.weight_dtype == torch.float32 and not torch_.model.native
    assert native.model.weight_bytes() < 0.6 * torch_.model.weight_bytes()
    for a, b in zip(_prompt_logits(native), _prompt_logits(torch_), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
    assert native.generate(PROMPTS, 8) == torch_.generate(PROMPTS, 8)
    assert native.kernels_label.startswith("native")
    assert torch_.kernels_label == "torch (runtime.cpu_kernels=torch)"


def test_long_prompt_chunks_widen_weights_for_pytorchs_gemm(make_ckpt):
    """Above 32 tokens per expert on average, experts run one by one on PyTorch's GEMM: same logits."""
    from engine.quality import prompt_logits

    path = make_ckpt("qwen3_moe", dtype="bfloat16", seed=6, experts=4, top_k=2)
    base = EngineConfig().replace(compute_dtype="float32")
    native, torch_ = Engine(path, base), Engine(path, base.replace(cpu_kernels="torch"))
    prompt = [(i * 7919) % native.spec.vocab_size for i in range(200)]  # 200 * 2 > 32 * 4 routed tokens
    a, b = prompt_logits(native, prompt), prompt_logits(torch_, prompt)
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


@pytest.mark.parametrize("tokens", [1, 3, 4, 9])
def test_int8_linear_matches_the_dequantized_weight(tokens):
    from engine.moe import quant

    g = torch.Generator().manual_seed(tokens)
    w = torch.randn(37, 100, generator=g)
    qw = quant.quantize(w, "int8")
    x = torch.randn(tokens, 100, generator=g)
    ref = F.linear(x, quant.dequantize(qw))
    torch.testing.assert_close(kernels.linear_int8(x, qw.data, qw.scales), ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="int8"):
        _ops().linear_int8(x, qw.data.float(), qw.scales)


def test_int8_experts_run_on_the_native_kernel(make_ckpt):
    from engine.quality import evaluate

    path = make_ckpt("qwen3_moe", dtype="bfloat16", seed=5, experts=16, top_k=4)
    eng = Engine(path, EngineConfig().replace(compute_dtype="float32", hi_precision="int8"))
    hybrid = eng.model.hybrid
    assert hybrid.native and hybrid.hi == "int8"
    v = hybrid.handles[eng.spec.moe_layers[0]][0].fast
    x = torch.randn(2, eng.spec.hidden_size)
    from engine.moe import quant

    torch.testing.assert_close(v.linear13(x, native=True), F.linear(x, quant.dequantize(v.w13)), rtol=1e-5,
                               atol=1e-4)
    # A whole layer in one fused call, against the expert-by-expert fp32 reference on the dequantized weights.
    layer = eng.spec.moe_layers[0]
    h = torch.randn(5, eng.spec.hidden_size)
    gates, ids = eng.model.route(eng.model.layers[layer], h)
    calls = hybrid.stats.expert_calls_fast_hi
    fused = hybrid._run_fused(layer, h, gates, ids)
    assert fused is not None and hybrid.stats.expert_calls_fast_hi == calls + len(set(ids.flatten().tolist()))
    w13 = torch.stack([quant.dequantize(hd.fast.w13) for hd in hybrid.handles[layer]])
    w2 = torch.stack([quant.dequantize(hd.fast.w2) for hd in hybrid.handles[layer]])
    torch.testing.assert_close(fused, _moe_reference(h, w13, w2, ids, gates), rtol=1e-4, atol=1e-4)
    res = evaluate(eng, [list(range(3, 40))])
    assert res["top1_agreement"] > 0.9


ISA_CHECK = """
import sys, torch, torch.nn.functional as F
torch.ops.load_library(sys.argv[1])
op = torch.ops.moetune
g = torch.Generator().manual_seed(0)
for dt in (torch.bfloat16, torch.float16):
    for t in (1, 3, 5):
        x, w, b = torch.randn(t, 100, generator=g), torch.randn(37, 100, generator=g).to(dt), torch.randn(37)
        torch.testing.assert_close(op.linear(x, w, b), F.linear(x, w.float(), b), rtol=1e-5, atol=1e-4)
q, s = torch.randint(-127, 128, (37, 100), dtype=torch.int8, generator=g), torch.rand(37)
x = torch.randn(3, 100, generator=g)
torch.testing.assert_close(op.linear_int8(x, q, s), F.linear(x, q.float() * s[:, None]), rtol=1e-5, atol=1e-3)
kc, vc, qd = torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16), torch.randn(1, 4, 16)
out = op.decode_attention(qd, kc, vc, torch.tensor([1]), torch.tensor([40]), 0, 0.25)
kk, vv = kc[1].repeat_interleave(2, 0), vc[1].repeat_interleave(2, 0)
ref = (torch.softmax(qd[0][:, None] @ kk.transpose(1, 2) * 0.25, -1) @ vv)[:, 0]
torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)
print(op.isa())
"""


@pytest.mark.parametrize("march,isa", [("haswell", "avx2"), ("x86-64", "scalar")])
def test_avx2_and_scalar_builds_agree_with_pytorch(march, isa, tmp_path, monkeypatch):
    """CPUs without AVX-512 get the AVX2 or scalar code: build those here and check them (each in its
    own process: one process can register the op namespace once)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 variants")
    if isa == "avx2" and not {"avx2", "fma", "f16c"} <= set(kernels._cpu_flags().split()):
        pytest.skip("this CPU cannot run AVX2 code")
    monkeypatch.setenv("MOETUNE_CACHE", str(tmp_path))
    lib = kernels._build(kernels._compiler(), march=march)
    script = tmp_path / "check.py"
    script.write_text(ISA_CHECK)
    res = subprocess.run([sys.executable, str(script), str(lib)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == isa
