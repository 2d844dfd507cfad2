"""From the knob registry to the residency controller's settings: one translation for every backend.

Both backends build their :class:`~engine.moe.policy.controller.ResidencyController` from
:func:`plan_settings`, so a live run and a run without tensors plan with the same numbers
(precisions, exact expert bytes, budgets, batching). No torch here.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.model.arch import ModelSpec
from engine.moe.policy.controller import PlanSettings
from engine.precision import expert_nbytes


def tier_precisions(config: EngineConfig, loaded: str) -> tuple[str, str | None]:
    """(precision of resident experts, precision of the low-precision copy or None) for weights
    loaded in ``loaded`` precision (``hi_precision="auto"`` keeps them as loaded)."""
    r = config.experts
    return (loaded if r.hi_precision == "auto" else r.hi_precision,
            None if r.lo_precision == "none" else r.lo_precision)


def plan_settings(config: EngineConfig, spec: ModelSpec, loaded: str) -> PlanSettings:
    """The controller's settings for ``config`` on model ``spec`` with experts loaded in ``loaded``."""
    r, x = config.experts, config.execution
    hi, lo = tier_precisions(config, loaded)
    group = r.int4_group_size
    h, i = spec.hidden_size, spec.expert_intermediate
    vector = tuple(float(w) for w in r.budget_layer_weights.split(",")) if r.budget_split == "vector" else None
    return PlanSettings(
        n_layers=len(spec.moe_layers), n_experts=spec.n_experts, residency=r.residency,
        budget_bytes=int(r.resident_budget_gib * 2**30), budget_split=r.budget_split, budget_vector=vector,
        bytes_hi=expert_nbytes(h, i, hi, group), bytes_lo=expert_nbytes(h, i, lo, group) if lo else None,
        bytes_host=expert_nbytes(h, i, loaded, group),
        resident_as_loaded=r.residency == "all" and hi == loaded,
        missing=x.missing_expert, batching=x.expert_batching, micro_batch_tokens=x.micro_batch_tokens,
        dynamic_half_life_tokens=float(r.dynamic_halflife_tokens), dynamic_replan_tokens=r.dynamic_replan_tokens,
        dynamic_hysteresis=r.dynamic_hysteresis, dynamic_max_swaps=r.dynamic_max_swaps_per_replan,
        cache_policy=r.cache_policy, prefetch_experts=r.prefetch_experts,
        max_replicas=x.max_replicas, replica_threshold=x.replica_threshold,
        replica_window_tokens=x.replica_window_tokens)
