"""Read Hugging Face layout checkpoints: config.json plus one or many safetensors files.

Never unpickles: safetensors only, opened memory-mapped and read one tensor at a time. Every problem
(unknown family, missing or misshapen tensor, truncated file) is a one-line CheckpointError naming
the file and the tensor or field.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.model.arch import (
    CheckpointError,
    ModelSpec,
    expected_tensors,
    expert_tensor_names,
    fused_expert_names,
    read_config,
    router_name,
)

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass
class TensorEntry:
    file: Path
    dtype: str
    shape: tuple[int, ...]


class Checkpoint:
    """An opened checkpoint directory: its config, spec, and an index of tensor name -> file."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a model directory")
        self.config, self.spec = read_config(self.dir)
        self.entries = self._index()
        self.layout = self._layout()
        self._check()

    # ---- discovery and validation (headers only, no tensor data read)
    def _files(self) -> list[Path]:
        index = self.dir / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index (missing or bad 'weight_map': {e})") from None
            files = sorted({self.dir / f for f in weight_map.values()})
            for f in files:
                if not f.exists():
                    raise CheckpointError(f"{index}: lists {f.name}, which does not exist")
            return files
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.dir}: no *.safetensors files (pickled .bin checkpoints are not loaded)")
        return files

    def _index(self) -> dict[str, TensorEntry]:
        entries: dict[str, TensorEntry] = {}
        for f in self._files():
            for name, (dtype, shape) in _read_header(f).items():
                if name in entries:
                    raise CheckpointError(f"{f}: tensor {name} also stored in {entries[name].file.name}")
                entries[name] = TensorEntry(f, dtype, shape)
        return entries

    def _layout(self) -> str:
        """``fused`` where the first MoE layer's experts are stacked, else the Hub's ``per_expert``."""
        if not self.spec.moe_layers:
            return "per_expert"
        first = self.spec.moe_layers[0]
        if all(n in self.entries for n in fused_expert_names(self.spec, first)) and not any(
                n in self.entries for n in expert_tensor_names(self.spec, first, 0)):
            return "fused"
        return "per_expert"  # missing tensors are then reported under the Hub's names

    def _check(self) -> None:
        for name, shape in expected_tensors(self.spec, self.layout).items():
            entry = self.entries.get(name)
            if entry is None:
                raise CheckpointError(f"{self.dir}: missing tensor {name}")
            if entry.shape != shape:
                raise CheckpointError(
                    f"{entry.file}: tensor {name} has shape {list(entry.shape)}, expected {list(shape)}")
            if entry.dtype not in DTYPES:
                raise CheckpointError(
                    f"{entry.file}: tensor {name} has dtype {entry.dtype}; supported: {', '.join(DTYPES)}")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype most of the weights are stored in."""
        counts: dict[str, int] = {}
        for e in self.entries.values():
            counts[e.dtype] = counts.get(e.dtype, 0) + 1
        return DTYPES[max(counts, key=lambda k: counts[k])]

    # ---- reading
    def tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) for ``names``, each file opened once and memory-mapped."""
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self.entries[n].file, []).append(n)
        with ExitStack() as stack:
            for f, ns in by_file.items():
                try:
                    handle = stack.enter_context(safe_open(str(f), framework="pt"))
                    for n in ns:
                        yield n, handle.get_tensor(n)
                except (OSError, RuntimeError, Exception) as e:  # safetensors raises its own error type
                    if isinstance(e, GeneratorExit):
                        raise
                    raise CheckpointError(f"{f}: cannot read tensors ({str(e).splitlines()[0]})") from None

    def get(self, name: str) -> torch.Tensor:
        return next(self.tensors([name]))[1]

    def router_name(self, layer: int) -> str:
        return router_name(self.spec, layer, self.layout)

    def read_experts(self, layer: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Copy one MoE layer's routed experts, in either layout, into stacked ``w13`` [E, 2I, H] (gate rows
        first, then up) and ``w2`` [E, H, I], converting to their dtype and device."""
        spec, inter = self.spec, self.spec.expert_intermediate
        if self.layout == "fused":
            gate_up, down = fused_expert_names(spec, layer)
            got = dict(self.tensors([gate_up, down]))
            w13.copy_(got[gate_up])
            w2.copy_(got[down])
            return
        names = [list(expert_tensor_names(spec, layer, e)) for e in range(spec.n_experts)]
        got = dict(self.tensors([n for trio in names for n in trio]))  # each file opened once per layer
        for e, (gate, up, down) in enumerate(names):
            w13[e, :inter] = got[gate]
            w13[e, inter:] = got[up]
            w2[e] = got[down]

    def fingerprint(self) -> str:
        """A hash of the config, the tensor index and the router weights (what decides routing).

        Cheap enough to compute on every load; two checkpoints with different routers never share it.
        """
        h = hashlib.sha256(json.dumps(self.config, sort_keys=True).encode())
        for name in sorted(self.entries):
            e = self.entries[name]
            h.update(f"{name}:{e.dtype}:{e.shape}".encode())
        routers = [self.router_name(i) for i in self.spec.moe_layers]
        for name, t in self.tensors(routers + ["model.embed_tokens.weight"]):
            if name == "model.embed_tokens.weight":
                t = t[:64]  # a sample: the embedding can be hundreds of MB
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.dir), "arch": self.spec.arch, "dtype": str(self.dtype).replace("torch.", ""),
                "layout": self.layout,
                "params": self.spec.total_params(), "active_params_per_token": self.spec.active_params_per_token()}


def _read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Parse a safetensors header and check that the file holds every byte it promises."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 * 1024 * 1024:
            raise CheckpointError(f"{path}: truncated or corrupt safetensors header (claims {n} bytes)")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: corrupt safetensors header (not JSON)") from None
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name}: malformed header entry") from None
        numel = 1
        for d in shape:
            numel *= d
        if dtype in _DTYPE_BYTES and end - begin != numel * _DTYPE_BYTES[dtype]:
            raise CheckpointError(f"{path}: tensor {name}: {end - begin} bytes for shape {list(shape)} {dtype}")
        data_end = max(data_end, end)
        out[name] = (dtype, shape)
    if 8 + n + data_end > size:
        raise CheckpointError(
            f"{path}: truncated: header promises {8 + n + data_end} bytes, the file has {size}")
    return out


def spec_of(model_dir: str | Path) -> ModelSpec:
    """Only the spec (config.json), without touching the weights."""
    return read_config(Path(model_dir))[1]
