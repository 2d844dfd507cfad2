"""The engine's reconfigure: which knob changes reload the weights and which do not."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.model.maker import make_model
from engine.runner import run_workload
from engine.runtime import Engine, greedy_rows
from workloads import Request, Workload


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("runtime-model")
    make_model(d, "qwen3_moe", "tiny", seed=5, dtype="bfloat16")
    return str(d)


def _tokens(engine: Engine) -> list[int]:
    wl = Workload("t", [Request("a", 0.0, 9, 6)], {"source": "test"})
    res = run_workload(engine, wl, mode="offline")
    return res.requests[0].output_ids


def test_spellings_of_the_same_weights_reload_nothing(bf16_dir):
    eng = Engine(bf16_dir, EngineConfig())
    assert eng.dtype == torch.float32  # the CPU computes in fp32 from the stored bf16 (native kernels or widened)
    model = eng.model
    before = _tokens(eng)
    eng.reconfigure(eng.config.replace(compute_dtype="float32", device="cpu", max_batch_seqs=3))
    assert eng.model is model and eng.config.scheduler.max_batch_seqs == 3
    assert _tokens(eng) == before
    # A different compute dtype or weight layout does reload.
    eng.reconfigure(eng.config.replace(compute_dtype="checkpoint"))
    assert eng.model is not model and eng.dtype == torch.bfloat16
    model = eng.model
    eng.reconfigure(eng.config.replace(compute_dtype="auto", cpu_kernels="torch"))
    assert eng.model is not model and eng.weight_dtype == torch.float32
    assert eng.loads_same_weights(eng.config.replace(cpu_kernels="torch", compute_dtype="float32"))
    from engine import kernels

    if kernels.load() is not None:  # the native kernels keep the stored bf16; PyTorch's products need fp32
        assert not eng.loads_same_weights(eng.config.replace(cpu_kernels="auto"))


def test_auto_compute_runs_the_native_kernels_wherever_they_load(bf16_dir):
    """compute_dtype=auto with the kernels: fp32 activations on the bf16 weights as stored, whatever PyTorch's
    own bf16 products measure here (the kernels' path table already weighs them per token count)."""
    from engine import kernels
    from engine.calibrate import cpu_compute_dtype

    assert kernels.load() is not None, kernels.status()  # CI builds the kernels: their absence is a failure
    eng = Engine(bf16_dir, EngineConfig())
    assert (eng.dtype, eng.weight_dtype) == (torch.float32, torch.bfloat16)
    assert eng.model.native and eng.kernels_label.startswith("native")
    for stored in (torch.bfloat16, torch.float16):
        assert cpu_compute_dtype(stored, 64, 32, "auto") == torch.float32
        assert cpu_compute_dtype(stored, 64, 32, "native") == torch.float32
    assert cpu_compute_dtype(torch.float32, 64, 32, "auto") == torch.float32


def test_a_reconfigure_back_to_a_layout_loaded_before_reuses_its_weights(bf16_dir):
    eng = Engine(bf16_dir, EngineConfig())
    first = eng.model
    before = _tokens(eng)
    eng.reconfigure(eng.config.replace(compute_dtype="checkpoint"))
    bf16 = eng.model
    assert bf16 is not first and eng.dtype == torch.bfloat16
    eng.reconfigure(eng.config.replace(compute_dtype="auto"))
    assert eng.model is first and eng.load_s < 0.05  # kept, not read again
    assert _tokens(eng) == before  # the same weights give the same tokens
    eng.reconfigure(eng.config.replace(compute_dtype="checkpoint", hi_precision="int8", residency="cache"))
    assert eng.model is bf16 and eng.model.hybrid is not None  # a spare gets this config's expert executor
    eng.reconfigure(eng.config.replace(compute_dtype="auto", hi_precision="auto", residency="all"))
    assert eng.model is first and eng.model.hybrid is None


def test_spare_weights_stay_within_their_memory_share(bf16_dir, monkeypatch):
    import engine.runtime as runtime

    eng = Engine(bf16_dir, EngineConfig())
    first = eng.model
    monkeypatch.setattr(runtime, "SPARE_MEMORY_SHARE", 0.0)  # no room: nothing is kept
    eng.reconfigure(eng.config.replace(compute_dtype="checkpoint"))
    eng.reconfigure(eng.config.replace(compute_dtype="auto"))
    assert eng.model is not first and not eng._spare_models.get(("cpu", "cpu", torch.bfloat16, torch.bfloat16))


def test_quantized_experts_are_built_once_per_loaded_weights(bf16_dir):
    eng = Engine(bf16_dir, EngineConfig())
    int8 = eng.config.replace(hi_precision="int8")
    eng.reconfigure(int8)
    layer = eng.spec.moe_layers[0]
    first = eng.model.hybrid.handles[layer][0].fast
    assert first.precision == "int8" and len(eng.model.version_cache) == len(eng.spec.moe_layers) * eng.spec.n_experts
    got = _tokens(eng)
    eng.reconfigure(int8.replace(max_batch_seqs=2))  # a new executor, the same quantized experts
    assert eng.model.hybrid.handles[layer][0].fast is first
    assert _tokens(eng) == got == _tokens(Engine(bf16_dir, int8))  # as a fresh engine quantizes them
    eng.reconfigure(int8.replace(hi_precision="int4", int4_group_size=32))
    assert eng.model.hybrid.handles[layer][0].fast.precision == "int4"
    assert len(eng.model.version_cache) == 2 * len(eng.spec.moe_layers) * eng.spec.n_experts


def test_greedy_rows_picks_what_torch_argmax_picks():
    """Ties (the first), NaN (counts as the largest), -inf rows, one row and many, a strided view, an
    inference tensor; a bf16 copy (torch's argmax) picks what the fp32 values (NumPy's) pick."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 1000, generator=g)
    x[1, [5, 700]] = 50.0  # a tie: the first
    x[2, 9] = float("nan")
    x[2, 3] = float("nan")  # NaN wins, the first of them
    x[3] = float("-inf")
    x[4, 999] = float("inf")
    cases = [x, x[:1], x[:, ::2], x.t().contiguous().t()]
    with torch.inference_mode():
        cases.append(x.clone())
    for c in cases:
        got = greedy_rows(c)
        assert got.dtype == torch.int64 and torch.equal(got, c.argmax(dim=-1))
    assert greedy_rows(x)[:5].tolist() == [int(x[0].argmax()), 5, 3, 0, 999]
    b = x.bfloat16()
    assert torch.equal(greedy_rows(b), greedy_rows(b.float()))
