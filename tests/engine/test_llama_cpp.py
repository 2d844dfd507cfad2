"""llama.cpp on the same checkpoint: the GGUF files written from it, and the comparison command.

The GGUF writer needs only the ``gguf`` package (a test extra): its files are read back with gguf's own
reader and checked tensor by tensor against the checkpoint. Running them needs llama-cpp-python (the
optional ``llama`` extra): where it is installed, llama.cpp's greedy tokens on a tiny checkpoint must
be the engine's; where it is not, the comparison must say so and measure the other systems.
"""

from __future__ import annotations

import json
import re
import signal

import numpy as np
import pytest

from engine import llama_cpp
from engine.cli import main
from engine.config import EngineConfig
from engine.model.checkpoint import Checkpoint
from engine.runtime import Engine

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 99, 100, 7]]


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt("qwen3_moe", dtype="bfloat16", seed=3)


def test_gguf_files_hold_the_checkpoint(ckpt, tmp_path):
    import gguf
    from gguf import GGMLQuantizationType as Q

    spec = Checkpoint(ckpt).spec
    embed = dict(Checkpoint(ckpt).tensors(["model.embed_tokens.weight"]))["model.embed_tokens.weight"].float()
    for kind in llama_cpp.GGUF_KINDS:
        r = gguf.GGUFReader(str(llama_cpp.write_gguf(ckpt, tmp_path / f"m-{kind}.gguf", kind)))
        arch = r.fields["general.architecture"]
        assert bytes(arch.parts[arch.data[0]]).decode() == "qwen3moe"
        t = {x.name: x for x in r.tensors}
        assert len(t) == 3 + spec.n_layers * 12
        exps = t["blk.0.ffn_gate_exps.weight"]
        assert list(exps.shape) == [spec.hidden_size, spec.expert_intermediate, spec.n_experts]  # GGUF: reversed
        want = {"bf16": (Q.BF16, Q.BF16), "q8_0": (Q.Q8_0, Q.Q8_0), "q4_0": (Q.Q8_0, Q.Q4_0)}[kind]
        assert (t["blk.0.attn_q.weight"].tensor_type, exps.tensor_type) == want
        assert t["blk.0.ffn_gate_inp.weight"].tensor_type == Q.F32 and t["output_norm.weight"].tensor_type == Q.F32
        e = t["token_embd.weight"]
        got = gguf.quants.dequantize(e.data, e.tensor_type).reshape(embed.shape)
        err = np.abs(got - embed.numpy()).max() / np.abs(embed.numpy()).max()
        assert err == 0 if kind == "bf16" else err < 0.02


def test_gguf_export_refuses_other_families(make_ckpt, tmp_path):
    from engine.model.arch import CheckpointError

    with pytest.raises(CheckpointError, match="qwen3_moe"):
        llama_cpp.write_gguf(make_ckpt("olmoe", dtype="bfloat16"), tmp_path / "x.gguf", "bf16")
    with pytest.raises(ValueError, match="q5_k"):
        llama_cpp.write_gguf(make_ckpt("qwen3_moe", dtype="bfloat16"), tmp_path / "x.gguf", "q5_k")


def test_llama_cpp_greedy_tokens_are_the_engines(ckpt, tmp_path):
    why = llama_cpp.available()
    if why is not None:  # the optional extra is absent: the comparison says so instead of failing
        assert "not installed" in why
        return
    ref = Engine(ckpt, EngineConfig().replace(compute_dtype="float32")).generate(PROMPTS, 8)
    for kind in ("bf16", "q8_0", "q4_0"):
        path = llama_cpp.write_gguf(ckpt, tmp_path / f"m-{kind}.gguf", kind)
        # In this process only where a child ran them: llama.cpp's AMX weights crash on some CPUs.
        extra, label = llama_cpp.extra_buffer_types(path, len(PROMPTS), 1)
        assert extra == (label == "on")
        r = llama_cpp.LlamaCpp(path, len(PROMPTS), 32, 1, extra_buffer_types=extra)
        try:
            prefill_s, steps, out = r.generate(PROMPTS, 8)
        finally:
            r.close()
        assert len(steps) == 7 and prefill_s > 0, kind
        if kind != "q4_0":  # 4-bit experts may pick other tokens
            assert out == ref, kind


def test_llama_cpp_runs_in_a_process_with_its_own_openmp_waits(ckpt, tmp_path):
    """compare-hf's llama.cpp: a child process where libgomp waits as it does outside moetune (this process
    spins as the engine set it), with the same greedy tokens; a file it cannot load is a one-line error."""
    from engine.env import apply_omp_wait_policy

    env, label = llama_cpp.own_environment()
    value, source = apply_omp_wait_policy()
    if source.startswith("moetune default"):
        assert env["GOMP_SPINCOUNT"] == "300000" and label == "libgomp default (GOMP_SPINCOUNT=300000)"
    else:  # the user's own settings hold for both
        assert label == f"{value} ({source})"
    with pytest.raises(RuntimeError, match="missing.gguf|llama_cpp"):
        llama_cpp.LlamaCppProcess(tmp_path / "missing.gguf", 1, 8, 1)
    if llama_cpp.available() is not None:
        return
    ref = Engine(ckpt, EngineConfig().replace(compute_dtype="float32")).generate(PROMPTS, 8)
    r = llama_cpp.LlamaCppProcess(llama_cpp.write_gguf(ckpt, tmp_path / "m.gguf", "bf16"), len(PROMPTS), 32, 1)
    try:
        prefill_s, steps, out = r.generate(PROMPTS, 8)
        with pytest.raises(RuntimeError, match="prompts"):  # an error in the child comes back, the child lives
            r.generate(PROMPTS * 2, 4)
        assert r.generate(PROMPTS, 8)[2] == ref
    finally:
        r.close()
    assert out == ref and len(steps) == 7 and prefill_s > 0 and r.proc.returncode == 0


def test_a_llama_cpp_child_that_dies_on_a_signal_is_named_a_crash(ckpt, tmp_path):
    """A child killed by a signal (as llama.cpp's AMX weights kill it on some CPUs) raises LlamaCppCrashed
    naming the signal, on the next call; llama.cpp without its extra buffer types gives the same tokens."""
    if llama_cpp.available() is not None:
        return
    path = llama_cpp.write_gguf(ckpt, tmp_path / "m.gguf", "bf16")
    r = llama_cpp.LlamaCppProcess(path, len(PROMPTS), 32, 1)
    r.proc.send_signal(signal.SIGSEGV)
    r.proc.wait()
    with pytest.raises(llama_cpp.LlamaCppCrashed, match="signal 11 [(]SIGSEGV[)]"):
        r.generate(PROMPTS, 4)
    r.close()
    ref = Engine(ckpt, EngineConfig().replace(compute_dtype="float32")).generate(PROMPTS, 8)
    plain = llama_cpp.LlamaCppProcess(path, len(PROMPTS), 32, 1, extra_buffer_types=False)
    try:
        assert plain.generate(PROMPTS, 8)[2] == ref
    finally:
        plain.close()


def test_eval_scores_llama_cpp_against_the_engines_reference(ckpt, capsys):
    """`engine eval --llama KIND`: llama.cpp's next-token agreement on the same prompts and fp32 reference as
    the engine's configs get, so their quality compares directly; coarser GGUFs drift further."""
    base = ["eval", "--model", str(ckpt), "--max-prompts", "2", "--json"]
    if llama_cpp.available() is not None:
        assert main([*base, "--llama", "q8_0"]) == 2
        assert "not installed" in capsys.readouterr().err
        return
    kl = {}
    for kind in ("bf16", "q8_0", "q4_0"):
        assert main([*base, "--llama", kind]) == 0
        res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert res["provenance"] == {"system": "llama.cpp", "gguf": kind,
                                     "extra_buffer_types": res["extra_buffer_types"]}
        assert res["extra_buffer_types"] == "on" or res["extra_buffer_types"].startswith("off: with them")
        assert res["prompts"] == 2 and res["positions"] == 128 and kind in res["gguf"]
        assert res["top1_agreement"] >= 0.9, (kind, res)
        kl[kind] = res["mean_kl"]
    assert 0 <= kl["bf16"] < kl["q8_0"] < kl["q4_0"] < 1e-2, kl
    assert main([*base, "--llama", "q5_k"]) == 2
    assert "'q5_k'" in capsys.readouterr().err
    assert main([*base, "--llama", "q8_0", "--text", "x.txt"]) == 2
    assert "--text" in capsys.readouterr().err


def test_compare_json_has_every_system_rooflines_and_targets(ckpt, capsys, native_kernels):
    assert main(["compare-hf", "--model", str(ckpt), "--batch", "1,2", "--prompt-len", "8", "--new-tokens", "4",
                 "--repeats", "1", "--rounds", "1", "--staggered", "0",
                 "--systems", "transformers,engine,engine_int8,engine_int8_a32,engine_int8_a16,engine_int8_a8,engine_q8,"
                 "engine_int4,llama_bf16",
                 "--json"]) == 0
    cap = capsys.readouterr()
    res = json.loads(cap.out.strip().splitlines()[-1])
    assert "int4_group_size=128" in res["skipped"]["engine_int4"]  # hidden 64: a one-line reason, not a crash
    measured = (["transformers", "engine", "engine_int8", "engine_int8_a32", "engine_int8_a16", "engine_int8_a8",
                 "engine_q8"]
                + (["llama_bf16"] if llama_cpp.available() is None else []))
    if llama_cpp.available() is not None:
        assert "not installed" in res["skipped"]["llama_bf16"]
    assert sorted(res["systems"]) == sorted(measured)
    # the rooflines take the best read bandwidth of the run: measured before the first round and after each
    assert len(res["mem_bw_samples_gb_per_s"]) == 2 and res["mem_bw_gb_per_s"] == max(res["mem_bw_samples_gb_per_s"])
    assert all(res["systems"][n]["openmp_waits"] for n in measured if n != "transformers")
    # one progress line per system and batch as it is measured, on stderr (stdout stays the JSON)
    progress = [ln for ln in cap.err.splitlines() if ln.startswith("compare-hf: round 1/1, ")]
    assert [ln.split(":")[1].strip() for ln in progress] == [f"round 1/1, {n}, batch {b}" for n in measured
                                                             for b in (1, 2)]
    for row in res["rows"]:
        for n in measured:
            assert row[f"{n}_decode_tokens_per_s"] > 0 and row[f"{n}_prefill_tokens_per_s"] > 0
            rf = row[f"{n}_roofline"]
            assert rf["bandwidth_roofline_tokens_per_s"] > 0 and rf["bound"] in ("bandwidth", "compute")
        assert row["engine_roofline"]["compute_roofline_tokens_per_s"] > 0
        # each engine row records which decode path ran: one native call a step for bf16 and int8 experts
        assert row["engine_decode_steps_fused"] == row["engine_int8_decode_steps_fused"] == 1.0
        assert row["engine_q8_decode_steps_fused"] == 1.0
        # int8 dense matrices too: fewer bytes again (attention and the lm head in int8)
        assert row["engine_q8_roofline"]["weight_bytes_per_step"] < row["engine_int8_roofline"]["weight_bytes_per_step"]
        # int8 experts read fewer bytes than bf16 ones
        assert row["engine_int8_roofline"]["weight_bytes_per_step"] < row["engine_roofline"]["weight_bytes_per_step"]
    assert {t["target"] for t in res["targets"]} >= {"prefill b=1: x transformers bf16",
                                                     "int8 experts, int8 activations b=1: x llama.cpp q8_0",
                                                     "int8 experts, int16 activations b=1: x llama.cpp q8_0",
                                                     "int8 weights (experts and dense) b=1: x llama.cpp q8_0"}
    # engine_int8_a32 keeps fp32 activations (the f32 mode at every token count); engine_int8_a8 quantizes them
    # (llama.cpp's q8_0 arithmetic), engine_int8_a16 to int16 (q16), engine_int8 takes the faster of f32 and q16
    # (auto): each records which, and its int8 paths say the same
    names = ("engine_int8", "engine_int8_a32", "engine_int8_a16", "engine_int8_a8")
    assert [res["systems"][n]["int8_activations"] for n in names] == ["auto", "fp32", "int16", "int8"]
    int8_paths = {n: re.search(r"; int8 ([^;]+);", res["systems"][n]["cpu_kernels"]).group(1) for n in names}
    assert ":f32" in int8_paths["engine_int8_a32"] and ":q" not in int8_paths["engine_int8_a32"], int8_paths
    assert ":q8" in int8_paths["engine_int8_a8"] and ":f32" not in int8_paths["engine_int8_a8"], int8_paths
    assert ":q16" in int8_paths["engine_int8_a16"] and ":q8" not in int8_paths["engine_int8_a16"], int8_paths
    auto = int8_paths["engine_int8"]
    assert ":q8" not in auto and (":f32" in auto) != (":q16" in auto), int8_paths
    assert res["systems"]["engine_q8"]["dense"] == "int8" and res["systems"]["engine"]["dense"] == "as_loaded"
    assert res["kernel_dispatch"]["available"]


def test_gguf_command_writes_the_files(ckpt, tmp_path, capsys):
    assert main(["gguf", "--model", str(ckpt), "--kinds", "q8_0", "--out", str(tmp_path), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["files"][0]["kind"] == "q8_0" and res["files"][0]["bytes"] > 0
    assert main(["gguf", "--model", str(ckpt), "--kinds", "q9"]) == 2
    assert "q9" in capsys.readouterr().err


def test_bench_counts_the_bytes_of_the_precisions_used(ckpt, capsys, native_kernels):
    """int8/int4 experts and a bf16 KV cache read fewer bytes than bf16 experts and an fp32 cache."""
    rows = {}
    for name, knobs in {"bf16": [], "int8": ["--hi-precision", "int8"],
                        "int4": ["--hi-precision", "int4", "--int4-group-size", "32"],
                        "kv": ["--kv-dtype", "bfloat16"]}.items():
        assert main(["bench", "--model", str(ckpt), "--batch", "2", "--prompt-len", "8", "--new-tokens", "4",
                     "--repeats", "1", "--compute-dtype", "float32", "--json", *knobs]) == 0
        rows[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"][0]
    w = {n: r["weight_bytes_per_decode_step"] for n, r in rows.items()}
    assert w["int4"] < w["int8"] < w["bf16"] == w["kv"]
    assert rows["kv"]["kv_bytes_per_decode_step"] * 2 == rows["bf16"]["kv_bytes_per_decode_step"]
    for r in rows.values():
        assert r["roofline_bound"] in ("bandwidth", "compute") and r["compute_roofline_decode_tokens_per_s"] > 0
        assert r["roofline_decode_tokens_per_s"] == min(r["bandwidth_roofline_decode_tokens_per_s"],
                                                        r["compute_roofline_decode_tokens_per_s"])
    assert rows["int8"]["decode_paths"]["experts"].startswith("int8/")
