"""``engine sweep``: each hybrid knob alone, per value: speed, memory, bytes moved between tiers, quality.

One model load; every value is applied with ``Engine.reconfigure`` (weights reload only when the
compute precision changes). Each row is the median of ``repeats`` runs of prefill + decode at one
batch size, plus the quality of that config against the model's fp32 reference.
"""

from __future__ import annotations

import statistics
from typing import Any

import psutil

from engine.bench import bench_batch
from engine.config import ConfigError, EngineConfig
from engine.precision import INT4_GROUP_SIZES
from engine.quality import evaluate, synthetic_prompts
from engine.runtime import Engine


def _reset_peak_rss() -> None:
    """Reset the kernel's high-water mark of this process's resident memory (Linux; no-op elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def _peak_rss_bytes(proc: psutil.Process) -> int:
    """Peak resident memory since the last reset (VmHWM), or the current RSS where unavailable."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return proc.memory_info().rss


def default_sweep(engine: Engine) -> dict[str, list[Any]]:
    """Values per knob; budgets are fractions of the model's expert bytes (so they fit any model)."""
    spec = engine.spec
    expert_bytes = len(spec.moe_layers) * spec.n_experts * spec.expert_params() * engine.weight_dtype.itemsize
    half_gib = round(expert_bytes * 0.5 / 2**30, 4)
    quarter_gib = round(expert_bytes * 0.25 / 2**30, 4)
    return {
        "cpu_kernels": ["auto", "torch"],
        "hi_precision": ["auto", "fp32", "int8", "int4"],
        "expert_batching": ["coalesced", "micro:4", "micro:16"],
        "top_k_override": [0, spec.top_k // 2, max(1, spec.top_k // 4)],
        "min_gate_weight": [0.0, 0.05, 0.1],
        "host_expert_threads": [0, 1],
        "residency": ["all", f"static:{half_gib}", f"static:{quarter_gib}+int8", f"cache:{half_gib}"],
    }


def _apply(base: EngineConfig, knob: str, value: Any, spec=None) -> EngineConfig:
    """Composite values: ``micro:N`` sets the micro-batch size, ``static:GiB[+lo]`` a budget and a fallback.
    With the model's ``spec``, int4 experts get the largest group size up to the configured one that divides
    the model's widths (a sweep's int4 row then measures int4 on any model, not a config error)."""
    if knob == "expert_batching" and isinstance(value, str) and value.startswith("micro:"):
        cfg = base.replace(expert_batching="micro", micro_batch_tokens=int(value.split(":")[1]))
    elif knob == "residency" and isinstance(value, str) and ":" in value:
        policy, rest = value.split(":", 1)
        budget, _, lo = rest.partition("+")
        cfg = base.replace(residency=policy, resident_budget_gib=float(budget))
        cfg = cfg.replace(lo_precision=lo) if lo else cfg
    else:
        cfg = base.replace(**{knob: value})
    if spec is not None and "int4" in (cfg.experts.hi_precision, cfg.experts.lo_precision):
        fits = [g for g in INT4_GROUP_SIZES if g <= cfg.experts.int4_group_size
                and spec.hidden_size % g == 0 and spec.expert_intermediate % g == 0]
        if fits:
            cfg = cfg.replace(int4_group_size=max(fits))
    return cfg


def run_sweep(engine: Engine, sweep: dict[str, list[Any]], batch: int, prompt_len: int, new_tokens: int,
              repeats: int, quality_prompts: int) -> dict[str, Any]:
    base = engine.config
    prompts = synthetic_prompts(engine.spec.vocab_size, n=quality_prompts, length=prompt_len)
    proc = psutil.Process()
    # Warm-up at the measured shapes: first-touch of buffers and kernels, and on CUDA its libraries' lazy
    # start-up and heuristics per shape (the H100's first row otherwise paid a prefill 3.6x slower).
    bench_batch(engine, batch, prompt_len, min(new_tokens, 4))
    rows = []
    for knob, values in sweep.items():
        for value in values:
            _reset_peak_rss()
            try:
                cfg = _apply(base, knob, value, engine.spec)
                engine.reconfigure(cfg)
            except (ConfigError, ValueError) as e:
                rows.append({"knob": knob, "value": str(value), "error": str(e)})
                continue
            engine.warm_up_hotness()
            runs = [bench_batch(engine, batch, prompt_len, new_tokens, seed=r)
                    for r in range(repeats)]
            tiers = engine.model.hybrid.stats.as_dict() if engine.model.hybrid is not None else {}
            q = evaluate(engine, prompts)
            rows.append({
                "knob": knob, "value": str(value), "config_hash": cfg.config_hash(),
                "prefill_tokens_per_s": statistics.median(r["prefill_tokens_per_s"] for r in runs),
                "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
                "peak_rss_gib": _peak_rss_bytes(proc) / 2**30,
                "fast_tier_expert_gib": (engine.model.hybrid.fast_bytes() / 2**30
                                         if engine.model.hybrid is not None else None),
                "bytes_to_fast": tiers.get("bytes_to_fast", 0),
                "host_expert_calls": tiers.get("expert_calls_host", 0),
                "top1_agreement": q["top1_agreement"], "mean_kl": q["mean_kl"],
            })
    engine.reconfigure(base)
    return {"model": str(engine.model_path), "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "repeats": repeats, "compute_dtype": str(engine.dtype).replace("torch.", ""),
            "weight_dtype": str(engine.weight_dtype).replace("torch.", ""), "cpu_kernels": engine.kernels_label,
            "rows": rows}
