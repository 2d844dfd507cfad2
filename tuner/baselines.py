"""Known-good and peer-style configurations, enqueued as the first trials of every study.

A baseline is a name, a one-line description and the knobs it sets (the rest come from the base
config, usually the engine's defaults). Its knobs may depend on the model and the machine (a
per-layer budget, say), so ``knobs`` may be a function of a :class:`BaselineContext`. A baseline
is enqueued only when every knob it sets is a parameter of the study's search space and its value
lies in range: a study that pins or drops a knob skips the baselines that need it.

Peer-style hybrid baselines: all experts on the host (llama.cpp ``--cpu-moe``), KTransformers'
frequency placement with a uniform per-layer budget, and Fiddler's rule (compute a missing expert
on the host unless fetching it is cheaper). They place experts between a fast tier and the host, so
they run only where an accelerator makes those two different memories. Others can be added with
:func:`register`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from tuner.space import SearchSpace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BaselineContext:
    """What a baseline may look at: the model spec, the machine and the base config."""

    spec: Any = None  # engine.model.arch.ModelSpec
    hardware: Mapping[str, Any] = field(default_factory=dict)
    base: EngineConfig = field(default_factory=EngineConfig)


KnobValues = Mapping[str, Any]


@dataclass(frozen=True)
class Baseline:
    """A named configuration: ``knobs`` maps knob keys (``scheduler.max_batch_seqs``) to values."""

    name: str
    description: str
    knobs: KnobValues | Callable[[BaselineContext], KnobValues]
    needs: str | None = None
    """``"accelerator"``: what tells this peer apart (where experts live) exists only with a fast tier
    apart from host memory; without one its config only reruns the defaults through the hybrid code path."""

    def values(self, ctx: BaselineContext) -> dict[str, Any]:
        """The knobs this baseline sets, for ``ctx``."""
        return dict(self.knobs(ctx) if callable(self.knobs) else self.knobs)


BASELINES: list[Baseline] = [
    Baseline("defaults", "the engine's defaults (or the base config given with --config)", {}),
    Baseline(
        "hf-static-like",
        "Hugging Face generate(): a few sequences at a time, whole prompts in one pass, checkpoint precision",
        {
            "scheduler.max_batch_seqs": 4,
            "scheduler.prefill_chunk_tokens": 2048,
            "scheduler.max_batch_tokens": 4096,
            "runtime.compute_dtype": "checkpoint",
        },
    ),
    Baseline(
        "llama.cpp-like",
        "llama.cpp server with one slot: one sequence, -b 2048 -ub 512, weights as stored (fp32 "
        "accumulation on the CPU, as its bf16 CPU path does)",
        lambda ctx: _llama_cpp(ctx),
    ),
]


def _llama_cpp(ctx: BaselineContext) -> dict[str, Any]:
    # On the CPU llama.cpp reads bf16/fp16 weights as stored and accumulates in fp32: here that is
    # compute_dtype=float32 with the native kernels keeping the weights as stored. On a GPU it computes
    # in the checkpoint's precision.
    return {"scheduler.max_batch_seqs": 1, "scheduler.max_batch_tokens": 2048, "scheduler.prefill_chunk_tokens": 512,
            "runtime.compute_dtype": "checkpoint" if _has_gpu(ctx) else "float32"}


def _expert_gib(ctx: BaselineContext, fraction: float) -> float:
    """``fraction`` of the model's expert weights in fp32, in GiB (a budget that fits any model)."""
    spec = ctx.spec
    if spec is None:
        raise ValueError("needs the model's shapes")
    total = len(spec.moe_layers) * spec.n_experts * spec.expert_params() * 4
    return round(total * fraction / 2**30, 6)


def _has_gpu(ctx: BaselineContext) -> bool:
    return bool(ctx.hardware.get("gpu"))


def _cpu_moe(ctx: BaselineContext) -> dict[str, Any]:
    knobs: dict[str, Any] = {"experts.residency": "static", "experts.resident_budget_gib": 0.0}
    if _has_gpu(ctx):  # without an accelerator the execution knob is inert and not in the space
        knobs["execution.missing_expert"] = "host"
    return knobs


def _ktransformers(ctx: BaselineContext) -> dict[str, Any]:
    knobs: dict[str, Any] = {"experts.residency": "static", "experts.budget_split": "uniform",
                             "experts.resident_budget_gib": _expert_gib(ctx, 0.25)}
    if _has_gpu(ctx):
        knobs["execution.missing_expert"] = "host"
    return knobs


def _fiddler(ctx: BaselineContext) -> dict[str, Any]:
    knobs: dict[str, Any] = {"experts.residency": "static", "experts.resident_budget_gib": _expert_gib(ctx, 0.25)}
    if _has_gpu(ctx):
        knobs["execution.missing_expert"] = "auto"
    return knobs


BASELINES += [
    Baseline("llama.cpp --cpu-moe", "every expert on the host, attention and the rest on the fast tier", _cpu_moe,
             needs="accelerator"),
    Baseline("ktransformers-like", "the hottest experts per layer resident (a quarter of the expert bytes, "
             "uniform per layer), the others computed on the host", _ktransformers, needs="accelerator"),
    Baseline("fiddler", "a quarter of the expert bytes resident; a missing expert runs on the host unless "
             "fetching it is cheaper by calibrated costs", _fiddler, needs="accelerator"),
]


def register(baseline: Baseline) -> None:
    """Add a baseline (replacing one of the same name)."""
    BASELINES[:] = [b for b in BASELINES if b.name != baseline.name] + [baseline]


def baseline_points(space: SearchSpace, ctx: BaselineContext, baselines: list[Baseline] | None = None,
                    skipped: list[tuple[str, str]] | None = None) -> list[tuple[Baseline, dict[str, Any]]]:
    """The baselines that are points of ``space``, each with its full parameter values.

    Parameters a baseline does not set take the base config's values. Baselines setting a knob
    outside the space, or a value out of range, are left out, and so are a baseline that ``needs``
    an accelerator on a machine without one and a baseline whose config is the same as an earlier
    one's on this machine: each is appended to ``skipped`` as (name, why), for the caller to say.
    """
    out = []

    def skip(name: str, why: str) -> None:
        log.info("baseline %s skipped: %s", name, why)
        if skipped is not None:
            skipped.append((name, why))

    seen: dict[str, str] = {}  # config hash -> the baseline that has it
    for b in BASELINES if baselines is None else baselines:
        if b.needs == "accelerator" and not _has_gpu(ctx):
            skip(b.name, "it places experts between a fast tier and the host, and without an accelerator they "
                 "are the same memory (it would rerun the defaults)")
            continue
        try:
            wanted = b.values(ctx)
        except (ValueError, KeyError, TypeError) as e:
            skip(b.name, str(e))
            continue
        values = {**space.defaults(ctx.base), **wanted}
        # Parameters the baseline turns off (a conditional child of a changed parent) drop out.
        values = {k: v for k, v in values.items()
                  if k in wanted or k not in space.keys or space.active(space.param(k), values)}
        # ...and children it turns on (residency=static enables the budget knobs) take the base's values.
        for k in space.keys:
            if k not in values and space.active(space.param(k), values):
                area, name = k.split(".", 1)
                values[k] = getattr(getattr(ctx.base, area), name)
        problems = space.problems(values)
        config_hash = None
        if not problems:
            try:
                config_hash = space.to_config(values, ctx.base, source=f"baseline {b.name}").config_hash()
            except ValueError as e:  # ConfigError: a combination the engine rejects
                problems = [str(e)]
        if problems:
            skip(b.name, "; ".join(problems))
            continue
        if config_hash in seen:
            # Knobs that tell two peers apart may be inert here (fiddler's host/fetch choice without an
            # accelerator): measuring the same config twice would only add noise.
            skip(b.name, f"the same config as {seen[config_hash]} on this machine")
            continue
        seen[config_hash] = b.name
        out.append((b, values))
    return out
