"""``engine bench``: prefill and decode speed per batch size, next to the binding roofline.

For each batch size B: B prompts of ``prompt_len`` random tokens are prefilled (timed; prompt chunks
as the scheduler forms them), then every sequence decodes ``new_tokens`` tokens together (timed per
step). Rooflines (:mod:`engine.roofline`): a decode step reads the dense weights, the lm head and the
experts its tokens actually touched, each in the precision it is kept in (int8/int4 with their
scales), plus the KV cache of every sequence; it computes their products and attention. The bandwidth
roofline divides those bytes by the measured read bandwidth, the compute roofline the FLOP by the
measured peak of each product's path; ``roofline_fraction`` is of the lower (binding) one. On an
accelerator both use its own measured limits (its memory, the host link, its matrix products' peak),
with the experts that decode computed on the host or fetched counted as the tiers counted them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from engine import kernels
from engine.roofline import machine_limits, roofline, step_cost, tier_shares
from engine.runtime import Engine


def prefill_then_decode(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float]]:
    """Prefill every prompt (timed as a whole), then decode them together; returns (prefill seconds,
    seconds of each decode step). Expert counts are reset in between, so they describe decode alone."""
    prefill_s = run_prefill(engine, prompts, new_tokens)
    return prefill_s, run_decode(engine)


def run_prefill(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Add the prompts and step until every sequence decodes; returns the seconds it took. Resets the
    expert counts afterwards, so that they describe the decode that follows."""
    for i, p in enumerate(prompts):
        engine.add(str(i), p, new_tokens)
    t = time.perf_counter()
    while any(not s.decoding for s in engine.running) or engine.waiting:
        engine.step()
    prefill_s = time.perf_counter() - t
    engine.model.stats.reset()
    if engine.model.ep is not None:
        engine.model.ep.stats.reset()
    return prefill_s


def run_decode(engine: Engine) -> list[float]:
    """Step until no sequence is left; returns the seconds of each step."""
    steps: list[float] = []
    while engine.has_work:
        steps.append(engine.step().duration_s)
    return steps


def _router_path(engine: Engine, tokens: int) -> str:
    """Where a step of ``tokens`` tokens runs its routers' fp32 products (the crossover measured per machine
    and router shape: :meth:`MoEDecoder.router_torch_from`)."""
    if not engine.spec.n_experts:
        return "-"
    return "fp32/native" if engine.model.routes_natively(tokens) else "fp32/torch"


def _tier_counts(engine: Engine, drain: bool = False) -> dict[str, int] | None:
    """The hybrid executor's tier counters (None without one); ``drain``: after its moves in flight."""
    hybrid = engine.model.hybrid
    if hybrid is None:
        return None
    if drain:
        hybrid.drain()
    return hybrid.stats.as_dict()


def bench_batch(engine: Engine, batch: int, prompt_len: int, new_tokens: int, seed: int = 0) -> dict[str, Any]:
    """Measure one batch size; returns prefill and decode rates and the decode roofline."""
    g = torch.Generator().manual_seed(seed + batch)
    vocab = engine.spec.vocab_size
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    cfg = engine.config.scheduler
    needed = engine.config.replace(
        max_batch_seqs=max(cfg.max_batch_seqs, batch),
        max_batch_tokens=max(cfg.max_batch_tokens, batch, cfg.prefill_chunk_tokens),
        max_seq_len_tokens=max(cfg.max_seq_len_tokens, prompt_len + new_tokens + 1))
    engine.reconfigure(needed)
    prefill_s = run_prefill(engine, prompts, new_tokens)
    before = _tier_counts(engine)
    step_s = run_decode(engine)
    touched = engine.model.stats.mean_distinct()  # measured: distinct experts per MoE layer per step
    tiers = tier_shares(before, _tier_counts(engine, drain=True))  # decode's host and fetched shares of expert calls
    limits = machine_limits(engine.device)
    step_med = statistics.median(step_s) if step_s else float("nan")
    decode_tps = batch / step_med
    # Each sequence's context grows from prompt_len to prompt_len + new_tokens - 1 while it decodes.
    decode = roofline(step_cost(engine, batch, touched, prompt_len + new_tokens / 2, tiers=tiers), limits)
    chunk = min(prompt_len, cfg.prefill_chunk_tokens)
    prefill_touched = engine.spec.n_experts * (1 - (1 - engine.spec.top_k / engine.spec.n_experts) ** chunk)
    prefill_roof = roofline(step_cost(engine, chunk, prefill_touched, prompt_len / 2 - chunk / 2, decode=False,
                                 tiers=tiers), limits)
    prefill_tps = batch * prompt_len / prefill_s
    ep = {}
    if engine.model.ep is not None:  # decode steps only (reset after the prefill)
        s = engine.model.ep.stats.summary()
        ep = {"ep_tokens_per_rank": s["tokens_per_rank"], "ep_imbalance": s["imbalance_mean"],
              "ep_step_imbalance": s["step_imbalance_mean"],
              "ep_bytes_combined_per_step": s["bytes_combined_per_step_mean"]}
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": prefill_tps,
        "decode_step_ms_median": step_med * 1e3,
        "decode_tokens_per_s": decode_tps,
        "decode_experts_touched_per_layer": touched,
        "weight_bytes_per_decode_step": decode["weight_bytes_per_step"],
        "kv_bytes_per_decode_step": decode["kv_bytes_per_step"],
        "bytes_per_decode_step": decode["bytes_per_step"],
        "flop_per_decode_step": decode["flop_per_step"],
        "achieved_gb_per_s": decode["bytes_per_step"] / step_med / 1e9,
        "achieved_gflop_per_s": decode["flop_per_step"] / step_med / 1e9,
        "mem_bw_gb_per_s": limits.read_gbps,  # the memory the step's device reads
        "limits": limits.as_dict(),
        "host_weight_bytes_per_decode_step": decode["host_weight_bytes_per_step"],
        "link_bytes_per_decode_step": decode["link_bytes_per_step"],
        "bandwidth_bound_by": decode["bandwidth_bound_by"],
        "decode_paths": {"dense": decode["dense_path"], "experts": decode["expert_path"],
                         "router": _router_path(engine, batch)},
        # Decode steps that ran every layer in one native call (MoEDecoder._decode_stack), of all decode steps.
        "decode_steps_fused": engine.model.stats.fused_steps / len(step_s) if step_s else 0.0,
        "bandwidth_roofline_decode_tokens_per_s": decode["bandwidth_roofline_tokens_per_s"],
        "compute_roofline_decode_tokens_per_s": decode["compute_roofline_tokens_per_s"],
        "roofline_decode_tokens_per_s": decode["roofline_tokens_per_s"],
        "roofline_bound": decode["bound"],
        "roofline_fraction": decode_tps / decode["roofline_tokens_per_s"],
        "prefill_paths": {"dense": prefill_roof["dense_path"], "experts": prefill_roof["expert_path"]},
        "roofline_prefill_tokens_per_s": prefill_roof["roofline_tokens_per_s"],
        "prefill_roofline_bound": prefill_roof["bound"],
        "prefill_roofline_fraction": prefill_tps / prefill_roof["roofline_tokens_per_s"],
        **ep,
    }


def run_bench(engine: Engine, batches: list[int], prompt_len: int, new_tokens: int, repeats: int = 1,
              warmup: bool = True) -> dict[str, Any]:
    if engine.hotness is None:
        engine.warm_up_hotness()  # placements by hotness (residency, expert parallelism) need a profile
    machine_limits(engine.device, fresh=True)  # this run's host bandwidth, for every row's roofline
    if warmup:
        bench_batch(engine, 1, min(prompt_len, 16), 4)
    rows = []
    for b in batches:
        runs = [bench_batch(engine, b, prompt_len, new_tokens, seed=r) for r in range(repeats)]
        row = dict(runs[0])
        for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "decode_step_ms_median", "achieved_gb_per_s",
                    "achieved_gflop_per_s", "roofline_fraction", "prefill_roofline_fraction", "prefill_s"):
            row[key] = statistics.median(r[key] for r in runs)
        row["repeats"] = repeats
        rows.append(row)
    return {"model": str(engine.model_path), "arch": engine.spec.arch, "device": str(engine.device),
            "compute_dtype": str(engine.dtype).replace("torch.", ""),
            "weight_dtype": str(engine.weight_dtype).replace("torch.", ""),
            "cpu_kernels": engine.kernels_label,
            "kv_dtype": str(engine.cache.dtype).replace("torch.", ""), "dense_precision": engine.model.dense_precision,
            "hi_precision": engine.model.hybrid.hi if engine.model.hybrid is not None else None,
            "kernel_dispatch": kernels.dispatch_report() if engine.model.native else None,
            "checkpoint_dtype": str(engine.ckpt.dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(), "ep_ranks": engine.config.parallel.ep_size,
            "weight_bytes": engine.model.weight_bytes(),
            "load_s": engine.load_s, "rows": rows}
