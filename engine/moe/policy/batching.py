"""How a step's tokens are cut for expert execution: one coalesced batch or micro-batches.

``coalesced`` (CoX-MoE): all of a step's tokens routed to an expert run as one matrix product.
``micro``: the step's tokens are cut into contiguous micro-batches of ``micro_batch_tokens`` so that
the transfer or host compute of one overlaps the device compute of another. Pure, deterministic.
"""

from __future__ import annotations

from typing import Literal


def micro_batches(n_tokens: int, micro_batch_tokens: int | None) -> list[slice]:
    """Contiguous slices of ``micro_batch_tokens`` tokens covering ``range(n_tokens)`` (the last may be
    shorter). ``None`` or a size >= ``n_tokens`` gives one slice; zero tokens gives no slice."""
    if isinstance(n_tokens, bool) or int(n_tokens) != n_tokens or n_tokens < 0:
        raise ValueError(f"n_tokens must be an integer >= 0, got {n_tokens!r}")
    n = int(n_tokens)
    if micro_batch_tokens is None:
        size = max(n, 1)
    elif isinstance(micro_batch_tokens, bool) or int(micro_batch_tokens) != micro_batch_tokens \
            or micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be an integer >= 1, got {micro_batch_tokens!r}")
    else:
        size = int(micro_batch_tokens)
    return [slice(a, min(a + size, n)) for a in range(0, n, size)]


def step_slices(n_tokens: int, mode: Literal["coalesced", "micro"], micro_batch_tokens: int | None = None) -> list[slice]:
    """The slices a step runs its experts over: one for ``coalesced``, :func:`micro_batches` for ``micro``."""
    if mode == "coalesced":
        return micro_batches(n_tokens, None)
    if mode == "micro":
        if micro_batch_tokens is None:
            raise ValueError("mode 'micro' needs micro_batch_tokens")
        return micro_batches(n_tokens, micro_batch_tokens)
    raise ValueError(f"mode must be 'coalesced' or 'micro', got {mode!r}")
