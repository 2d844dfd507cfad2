"""Checkpoint loading: every bad checkpoint is refused with one line naming the file and the tensor or
field; sharded and unsharded layouts and every supported dtype load; the fingerprint follows the weights.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model.arch import ARCHS, CheckpointError, expected_tensors, expert_tensor_names, router_name
from engine.model.checkpoint import INDEX_FILE, Checkpoint, spec_of

# Logits of a checkpoint stored in a narrower dtype, computed in fp32, against the fp32 checkpoint of
# the same seed: only the stored weights' rounding differs (bf16 keeps 8 bits, fp16 11). Measured on
# the tiny models: 1.3e-3 (bf16), 1.7e-4 (fp16) with logits up to ~0.5; the bounds leave ~8x headroom.
STORED_DTYPE_TOL = {"float32": 0.0, "float16": 2e-3, "bfloat16": 1e-2}


def refused(path: Path) -> str:
    """Open ``path``; it must fail with a one-line CheckpointError, whose text is returned."""
    with pytest.raises(CheckpointError) as info:
        Checkpoint(path)
    message = str(info.value)
    assert "\n" not in message, f"error is more than one line: {message!r}"
    return message


@pytest.fixture
def copy_of(make_ckpt, tmp_path) -> Callable[..., Path]:
    """A private copy of a session checkpoint, which the test may damage."""

    def copy(arch: str = "qwen3_moe", **kwargs) -> Path:
        dst = tmp_path / f"{arch}-copy"
        shutil.copytree(make_ckpt(arch, **kwargs), dst)
        return dst

    return copy


def edit_config(path: Path, edit: Callable[[dict], None]) -> Path:
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    edit(cfg)
    cfg_path.write_text(json.dumps(cfg))
    return cfg_path


def rewrite_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return file


def logits_of(path: Path, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits of a fixed 9-token prompt and two fixed decode tokens: [3, V]."""
    from engine.model.decoder import KVCache, MoEDecoder, Segment, StepBatch

    ckpt = Checkpoint(path)
    decoder = MoEDecoder(ckpt, compute_dtype, torch.device("cpu"))
    cache = KVCache(ckpt.spec, 1, 64, compute_dtype, torch.device("cpu"))
    prompt = torch.arange(9) * 37 % ckpt.spec.vocab_size + 3
    rows = [decoder.forward(StepBatch(prompt, torch.arange(9), [Segment(0, 0, 9, 0, True)]), cache)]
    for pos, tok in ((9, 101), (10, 202)):
        rows.append(decoder.forward(StepBatch(torch.tensor([tok]), torch.tensor([pos]),
                                              [Segment(0, 0, 1, pos, True)]), cache))
    return torch.cat(rows)


# ------------------------------------------------------------------ config.json
def test_unknown_model_type(copy_of):
    path = copy_of()
    cfg = edit_config(path, lambda c: c.update(model_type="llama"))
    message = refused(path)
    assert str(cfg) in message and "model_type" in message and "llama" in message


@pytest.mark.parametrize(("arch", "field"), [
    ("qwen3_moe", "num_experts"),
    ("qwen2_moe", "moe_intermediate_size"),
    ("mixtral", "num_local_experts"),
    ("olmoe", "intermediate_size"),
    ("olmoe", "num_experts_per_tok"),
    ("mixtral", "hidden_size"),
    ("qwen3_moe", "vocab_size"),
])
def test_missing_field(arch, field, copy_of):
    path = copy_of(arch)
    cfg = edit_config(path, lambda c: c.pop(field))
    message = refused(path)
    assert str(cfg) in message and f"'{field}'" in message


@pytest.mark.parametrize(("field", "value"), [
    ("num_experts_per_tok", 9),  # more than the 8 experts
    ("num_key_value_heads", 3),  # does not divide 4 heads
    ("hidden_act", "gelu"),
    ("num_experts", 0),
    ("num_hidden_layers", "2"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
])
def test_unsupported_field_value(field, value, copy_of):
    path = copy_of()
    cfg = edit_config(path, lambda c: c.update({field: value}))
    message = refused(path)
    assert str(cfg) in message and field.replace("rope_scaling", "rope_type") in message


def test_config_not_json(copy_of):
    path = copy_of()
    (path / "config.json").write_text('{"model_type": "qwen3_moe", ')
    message = refused(path)
    assert str(path / "config.json") in message and "JSON" in message


def test_config_missing(copy_of):
    path = copy_of()
    (path / "config.json").unlink()
    assert str(path / "config.json") in refused(path)


def test_not_a_directory(tmp_path):
    assert str(tmp_path / "nowhere") in refused(tmp_path / "nowhere")


# ------------------------------------------------------------------ tensors
@pytest.mark.parametrize("arch", ARCHS)
def test_missing_expert_tensor(arch, copy_of):
    """One expert's down projection left out of the file: named, with the checkpoint it is missing from."""
    path = copy_of(arch)
    spec = spec_of(path)
    down = list(expert_tensor_names(spec, spec.moe_layers[-1], 3))[2]
    rewrite_weights(path, lambda t: t.pop(down))
    message = refused(path)
    assert str(path) in message and down in message


@pytest.mark.parametrize(("arch", "name", "shape"), [
    ("qwen3_moe", "model.layers.1.mlp.experts.5.gate_proj.weight", (33, 64)),
    ("mixtral", "model.layers.0.self_attn.o_proj.weight", (64, 32)),
    ("olmoe", "model.layers.0.self_attn.q_norm.weight", (16,)),
    ("qwen2_moe", "model.layers.1.mlp.shared_expert_gate.weight", (64,)),
    ("qwen3_moe", "lm_head.weight", (511, 64)),
])
def test_wrong_shape(arch, name, shape, copy_of):
    path = copy_of(arch)
    file = rewrite_weights(path, lambda t: t.update({name: torch.zeros(shape)}))
    message = refused(path)
    assert str(file) in message and name in message and str(list(shape)) in message
    assert str(list(expected_tensors(spec_of(path))[name])) in message


def test_unsupported_tensor_dtype(copy_of):
    path = copy_of()
    name = "model.layers.0.self_attn.k_proj.weight"
    file = rewrite_weights(path, lambda t: t.update({name: t[name].double()}))
    message = refused(path)
    assert str(file) in message and name in message and "F64" in message


@pytest.mark.parametrize("keep", ["half", "4 bytes", "inside header"])
def test_truncated_file(keep, copy_of):
    """Cut anywhere, the file is refused when the checkpoint is opened (not later, mid-run)."""
    path = copy_of()
    file = path / "model.safetensors"
    data = file.read_bytes()
    n = {"half": len(data) // 2, "4 bytes": 4, "inside header": 40}[keep]
    file.write_bytes(data[:n])
    message = refused(path)
    assert str(file) in message and "truncated" in message


def test_truncated_shard(make_ckpt, tmp_path):
    path = tmp_path / "sharded"
    shutil.copytree(make_ckpt("mixtral", shard_bytes=64 * 1024), path)
    shard = sorted(path.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size - 100])
    message = refused(path)
    assert str(shard) in message


def test_index_names_missing_shard(make_ckpt, tmp_path):
    path = tmp_path / "sharded"
    shutil.copytree(make_ckpt("mixtral", shard_bytes=64 * 1024), path)
    shard = sorted(path.glob("*.safetensors"))[2]
    shard.unlink()
    message = refused(path)
    assert str(path / INDEX_FILE) in message and shard.name in message


def test_index_not_json(make_ckpt, tmp_path):
    path = tmp_path / "sharded"
    shutil.copytree(make_ckpt("mixtral", shard_bytes=64 * 1024), path)
    (path / INDEX_FILE).write_text("{not json")
    assert str(path / INDEX_FILE) in refused(path)


def test_tensor_in_two_shards(make_ckpt, tmp_path):
    path = tmp_path / "sharded"
    shutil.copytree(make_ckpt("mixtral", shard_bytes=64 * 1024), path)
    first, second = sorted(path.glob("*.safetensors"))[:2]
    name = sorted(load_file(first))[0]
    tensors = load_file(second)
    tensors[name] = load_file(first)[name]
    save_file(tensors, second, metadata={"format": "pt"})
    message = refused(path)
    assert name in message and first.name in message and second.name in message


class _Trap:
    """Unpickling this creates a directory: the proof that someone unpickled the file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_pickle_checkpoint_refused_without_unpickling(copy_of, tmp_path, monkeypatch):
    """A directory holding only pytorch_model.bin is refused; nothing is unpickled on the way."""
    path = copy_of()
    for f in path.glob("*.safetensors"):
        f.unlink()
    marker = tmp_path / "unpickled"
    (path / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": _Trap(marker)}))

    def forbidden(*args, **kwargs):
        raise AssertionError("a user's file was unpickled")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    message = refused(path)
    assert str(path) in message and ".bin" in message
    assert not marker.exists()


# ------------------------------------------------------------------ layouts and dtypes that load
@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_equals_unsharded(arch, make_ckpt):
    single = make_ckpt(arch)
    sharded = make_ckpt(arch, shard_bytes=64 * 1024)
    assert not (single / INDEX_FILE).exists()
    index = json.loads((sharded / INDEX_FILE).read_text())
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) >= 3
    assert sorted({sharded / f for f in index["weight_map"].values()}) == shards
    assert set(index["weight_map"]) == set(expected_tensors(spec_of(sharded)))
    a, b = Checkpoint(single), Checkpoint(sharded)
    names = sorted(a.entries)
    assert names == sorted(b.entries)
    got = dict(b.tensors(names))  # yielded file by file: compare by name
    for name, x in a.tensors(names):
        assert torch.equal(x, got[name]), name  # the same bytes, wherever the shards put them
    # Logits agree to float rounding, not bit for bit: MKL's fp32 GEMM picks its blocking by the
    # weights' address, and the shards place tensors at other offsets (1.0e-7 measured on an AMD EPYC).
    torch.testing.assert_close(logits_of(single), logits_of(sharded), rtol=0, atol=1e-6)
    assert a.fingerprint() == b.fingerprint()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_stored_dtypes_load(arch, dtype, make_ckpt):
    """Each stored dtype loads; in fp32 it gives the fp32 checkpoint's logits up to the weights'
    rounding, and it also runs in its own dtype."""
    path = make_ckpt(arch, dtype=dtype)
    ckpt = Checkpoint(path)
    torch_dtype = getattr(torch, dtype)
    assert ckpt.dtype == torch_dtype
    assert {e.dtype for e in ckpt.entries.values()} == {{"float32": "F32", "bfloat16": "BF16",
                                                         "float16": "F16"}[dtype]}
    assert ckpt.get("model.norm.weight").dtype == torch_dtype
    reference = logits_of(make_ckpt(arch, dtype="float32"))
    torch.testing.assert_close(logits_of(path), reference, rtol=0, atol=STORED_DTYPE_TOL[dtype])
    native = logits_of(path, torch_dtype)
    assert native.dtype == torch.float32 and torch.isfinite(native).all()


# ------------------------------------------------------------------ fingerprint
def test_fingerprint_follows_the_weights(make_ckpt, tmp_path):
    a = Checkpoint(make_ckpt("qwen3_moe", seed=0)).fingerprint()
    again = tmp_path / "again"
    shutil.copytree(make_ckpt("qwen3_moe", seed=0), again)
    assert Checkpoint(again).fingerprint() == a
    assert Checkpoint(make_ckpt("qwen3_moe", seed=1)).fingerprint() != a
    assert Checkpoint(make_ckpt("qwen3_moe", seed=0, router_skew=0.0)).fingerprint() != a
    assert Checkpoint(make_ckpt("olmoe", seed=0)).fingerprint() != a


def test_fingerprint_sees_a_changed_router(make_ckpt, tmp_path):
    """Same config, one router weight changed: routing changes, so the fingerprint must."""
    path = tmp_path / "ckpt"
    shutil.copytree(make_ckpt("qwen3_moe"), path)
    before = Checkpoint(path).fingerprint()
    name = router_name(spec_of(path), 1)

    def nudge(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].clone()
        t[name][7, 3] += 0.5

    rewrite_weights(path, nudge)
    assert Checkpoint(path).fingerprint() != before


@pytest.mark.parametrize("expert", [3, 100])
def test_fingerprint_sees_every_router_row(expert, make_ckpt, tmp_path):
    """128 experts (Qwen3-30B-A3B has 128): a change to any expert's router row changes routing, so it
    must change the fingerprint, whichever row it is."""
    path = tmp_path / "ckpt"
    shutil.copytree(make_ckpt("qwen3_moe", experts=128, top_k=8, width=16), path)
    before = Checkpoint(path).fingerprint()
    name = router_name(spec_of(path), 0)

    def nudge(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].clone()
        t[name][expert] += 0.5

    rewrite_weights(path, nudge)
    assert Checkpoint(path).fingerprint() != before
