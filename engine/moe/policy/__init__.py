"""Placement policies of the hybrid MoE engine: pure, deterministic decisions with no device in them.

Which experts are resident and in which precision (:mod:`.residency`), which are replicated
(:mod:`.replication`), whether a missing expert runs on the host or is fetched (:mod:`.execution`),
how a step's tokens are cut (:mod:`.batching`) and which routes are pruned (:mod:`.routing`); per
step and MoE layer, the plan that puts them together (:mod:`.plan`), made by the residency
controller (:mod:`.controller`). They import only numpy and the standard library, so every backend
runs the same code.
"""

from engine.moe.policy.batching import micro_batches, step_slices
from engine.moe.policy.controller import PlanSettings, ResidencyController
from engine.moe.policy.execution import (
    ComputeCost,
    CostModel,
    LinkCost,
    crossover_tokens,
    decide,
    fit_compute_cost,
    plan_layer,
)
from engine.moe.policy.plan import (
    DecisionLog,
    ExpertRun,
    LayerDecision,
    MoEStats,
    PartPlan,
    ReplicaChange,
    StepMoves,
    TierStats,
    plan_runs,
)
from engine.moe.policy.replication import plan_replicas, split_slices, split_tokens
from engine.moe.policy.residency import (
    CacheAccess,
    DynamicResidency,
    ExpertCache,
    Move,
    ReplanResult,
    ResidencyPlan,
    TransitionTable,
    layer_budgets,
    plan_static,
    rank_experts,
)
from engine.moe.policy.routing import prune_routes

__all__ = [
    "CacheAccess", "ComputeCost", "CostModel", "DecisionLog", "DynamicResidency", "ExpertCache", "ExpertRun",
    "LayerDecision", "LinkCost", "MoEStats", "Move", "PartPlan", "PlanSettings", "ReplanResult", "ReplicaChange",
    "ResidencyController", "ResidencyPlan", "StepMoves", "TierStats", "TransitionTable", "crossover_tokens",
    "decide", "fit_compute_cost", "layer_budgets", "micro_batches", "plan_layer", "plan_replicas", "plan_runs",
    "plan_static", "prune_routes", "rank_experts", "split_slices", "split_tokens", "step_slices",
]
