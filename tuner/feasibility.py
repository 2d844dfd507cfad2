"""Will a config fit in memory? Decided from shapes before any model work (pure arithmetic).

The engine's KV cache holds ``max_batch_seqs`` slots of ``max_seq_len_tokens`` tokens per layer
at the compute precision, and grows by doubling (old and new tensors coexist while it copies);
the weights are resident once, twice while a change of precision reloads them. A config whose
estimate exceeds the memory available is infeasible: it is recorded as such and never run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Growth by doubling keeps the old half while the new tensor fills: 1.5x the final size.
KV_GROWTH_PEAK = 1.5
#: Activation scratch per token in the step, in units of hidden-size floats (residual, attention,
#: gate/up/down of the top-k experts); generous on purpose.
_ACTIVATION_HIDDEN_UNITS = 16


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a config needs on its compute device, by part."""

    weights_bytes: int
    kv_cache_bytes: int
    activations_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.activations_bytes


def estimate_memory(spec: Any, config: Any, dtype_bytes: int, *, reload_weights: bool,
                    weight_dtype_bytes: int | None = None) -> MemoryEstimate:
    """What ``config`` (an ``EngineConfig``) adds to the process on top of what it holds now.

    ``spec`` is the model's ``ModelSpec``; ``dtype_bytes`` the compute dtype's (KV cache) and
    ``weight_dtype_bytes`` the weights' (the same unless native kernels read half-precision weights);
    ``reload_weights`` says the precision changes, so a second copy of the weights exists while the new
    one loads.
    """
    s = config.scheduler
    kv = spec.kv_bytes_per_token(dtype_bytes) * s.max_batch_seqs * s.max_seq_len_tokens
    acts = s.max_batch_tokens * (_ACTIVATION_HIDDEN_UNITS * spec.hidden_size
                                 + spec.top_k * spec.expert_intermediate * 3) * 4
    acts += min(s.max_batch_seqs, s.max_batch_tokens) * spec.vocab_size * 4  # logits
    weights = spec.total_params() * (weight_dtype_bytes or dtype_bytes) if reload_weights else 0
    return MemoryEstimate(int(weights), int(kv * KV_GROWTH_PEAK), int(acts))


def memory_problem(estimate: MemoryEstimate, available_bytes: int) -> str | None:
    """A one-line reason when ``estimate`` does not fit in ``available_bytes``, else None."""
    if estimate.total_bytes <= available_bytes:
        return None
    gib = 2**30
    return (f"needs about {estimate.total_bytes / gib:.2f} GiB (KV cache {estimate.kv_cache_bytes / gib:.2f}, "
            f"activations {estimate.activations_bytes / gib:.2f}, weights reload {estimate.weights_bytes / gib:.2f})"
            f" but {available_bytes / gib:.2f} GiB is available")
