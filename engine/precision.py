"""Precisions of weights: the one table of names and torch dtypes, and exact byte sizes (no torch needed).

Precision names (``fp32``, ``bf16``, ``fp16``, ``int8``, ``int4``) are what the knob registry, plans,
results and the decision log speak; torch dtypes are what tensors have. This module maps between
them once. Byte sizes are exact (they equal the ``nbytes`` of the tensors :mod:`engine.moe.quant`
builds), so the live engine and a backend without tensors account the same bytes.
"""

from __future__ import annotations

from typing import Any

FLOAT_PRECISIONS: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Float precision -> name of the torch dtype it is stored in."""
FLOAT_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
INT_PRECISIONS = ("int8", "int4")
PRECISIONS = (*FLOAT_PRECISIONS, *INT_PRECISIONS)
INT4_GROUP_SIZES = (32, 64, 128, 256)
"""int4 group sizes (input channels per scale) the packed kernels (CPU and tinygemm) accept."""
def int4_groups_dividing(widths: tuple[int, ...] | list[int], sizes: tuple[int, ...] = INT4_GROUP_SIZES
                         ) -> tuple[int, ...]:
    """The group sizes of ``sizes`` that divide every one of ``widths`` (a model's hidden size and expert width)."""
    return tuple(g for g in sizes if all(w % g == 0 for w in widths))


INT4_ROW_MULTIPLE = 16
"""int4 output rows are padded to this (CPU kernel: N % 16; tinygemm: N % 8)."""
SCALE_BYTES = 2
"""Bytes of one quantization scale or zero point (bf16)."""

_PRECISION_OF_NAME = {name: p for p, name in FLOAT_PRECISIONS.items()}


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` (or ``"torch.bfloat16"``, ``"bfloat16"``) -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")


def precision_of(dtype: Any) -> str:
    """The precision name of a float torch dtype or dtype name: ``torch.bfloat16`` -> ``"bf16"``."""
    name = dtype_name(dtype)
    if name not in _PRECISION_OF_NAME:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(_PRECISION_OF_NAME)}")
    return _PRECISION_OF_NAME[name]


def torch_dtype(name: str) -> Any:
    """The torch dtype of a float precision (``"bf16"``) or dtype name (``"bfloat16"``)."""
    import torch

    key = FLOAT_PRECISIONS.get(name, name)
    if key not in _PRECISION_OF_NAME:
        raise ValueError(f"{name!r} is not a float precision or dtype name")
    return getattr(torch, key)


def check_group_size(in_features: int, group_size: int, source: str = "in_features") -> None:
    """Raise ``ValueError`` (one line) unless int4 with ``group_size`` can quantize ``in_features`` columns.

    ``source`` names the dimension in the message (e.g. ``"hidden_size"``). The group size must be
    positive and divide the dimension, and the dimension must be even (two values per byte). Group
    sizes outside :data:`INT4_GROUP_SIZES` are valid but run through the slow ``dequant`` path.
    """
    if group_size <= 0:
        raise ValueError(f"int4 group_size={group_size} must be positive")
    if in_features % group_size:
        raise ValueError(f"int4 group_size={group_size} does not divide {source}={in_features}")
    if in_features % 2:
        raise ValueError(f"int4 needs an even {source}, got {source}={in_features}")


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def weight_nbytes(out_features: int, in_features: int, precision: str, group_size: int) -> int:
    """Exact bytes of an ``[out, in]`` matrix in ``precision`` (``group_size`` is read by int4 only)."""
    if precision in FLOAT_BYTES:
        return out_features * in_features * FLOAT_BYTES[precision]
    if precision == "int8":
        return out_features * in_features + out_features * SCALE_BYTES
    if precision == "int4":
        check_group_size(in_features, group_size)
        n_pad = _round_up(out_features, INT4_ROW_MULTIPLE)
        return n_pad * in_features // 2 + (in_features // group_size) * n_pad * 2 * SCALE_BYTES
    raise ValueError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")


def expert_nbytes(hidden: int, inter: int, precision: str, group_size: int) -> int:
    """Exact bytes of one expert, gate+up ``[2I, H]`` and down ``[H, I]``, in ``precision``."""
    if precision == "int4":
        check_group_size(hidden, group_size, "hidden_size")
        check_group_size(inter, group_size, "expert_intermediate")
    return weight_nbytes(2 * inter, hidden, precision, group_size) + weight_nbytes(hidden, inter, precision,
                                                                                  group_size)
