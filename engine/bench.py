"""``engine bench``: prefill and decode speed per batch size, next to the memory-bandwidth roofline.

For each batch size B: B prompts of ``prompt_len`` random tokens are prefilled (timed; prompt chunks
as the scheduler forms them), then every sequence decodes ``new_tokens`` tokens together (timed per
step). The roofline divides the bytes of weights a decode step reads (dense weights, lm head, and the
experts the step's tokens actually touched) by the machine's measured read bandwidth.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from engine.calibrate import memory_bandwidth_gbps
from engine.runtime import Engine


def prefill_then_decode(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float]]:
    """Prefill every prompt (timed as a whole), then decode them together; returns (prefill seconds,
    seconds of each decode step). Expert counts are reset in between, so they describe decode alone."""
    for i, p in enumerate(prompts):
        engine.add(str(i), p, new_tokens)
    t = time.perf_counter()
    while any(not s.decoding for s in engine.running) or engine.waiting:
        engine.step()
    prefill_s = time.perf_counter() - t
    engine.model.stats.reset()
    if engine.model.ep is not None:
        engine.model.ep.stats.reset()
    steps: list[float] = []
    while engine.has_work:
        steps.append(engine.step().duration_s)
    return prefill_s, steps


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
    prefill_s, step_s = prefill_then_decode(engine, prompts, new_tokens)
    touched = engine.model.stats.mean_distinct()  # measured: distinct experts per MoE layer per step
    dtype_bytes = engine.weight_dtype.itemsize  # the bytes the products read, as the weights are kept
    bytes_per_step = engine.spec.weight_bytes_touched(batch, dtype_bytes, touched)
    bw = memory_bandwidth_gbps()
    step_med = statistics.median(step_s) if step_s else float("nan")
    decode_tps = batch / step_med
    roofline_tps = batch * bw * 1e9 / bytes_per_step
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
        "prefill_tokens_per_s": batch * prompt_len / prefill_s,
        "decode_step_ms_median": step_med * 1e3,
        "decode_tokens_per_s": decode_tps,
        "decode_experts_touched_per_layer": touched,
        "weight_bytes_per_decode_step": bytes_per_step,
        "achieved_gb_per_s": bytes_per_step / step_med / 1e9,
        "mem_bw_gb_per_s": bw,
        "roofline_decode_tokens_per_s": roofline_tps,
        "roofline_fraction": decode_tps / roofline_tps,
        **ep,
    }


def run_bench(engine: Engine, batches: list[int], prompt_len: int, new_tokens: int, repeats: int = 1,
              warmup: bool = True) -> dict[str, Any]:
    if engine.hotness is None:
        engine.warm_up_hotness()  # placements by hotness (residency, expert parallelism) need a profile
    if warmup:
        bench_batch(engine, 1, min(prompt_len, 16), 4)
    rows = []
    for b in batches:
        runs = [bench_batch(engine, b, prompt_len, new_tokens, seed=r) for r in range(repeats)]
        row = dict(runs[0])
        for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "decode_step_ms_median", "achieved_gb_per_s",
                    "roofline_fraction", "prefill_s"):
            row[key] = statistics.median(r[key] for r in runs)
        row["repeats"] = repeats
        rows.append(row)
    return {"model": str(engine.model_path), "arch": engine.spec.arch, "device": str(engine.device),
            "compute_dtype": str(engine.dtype).replace("torch.", ""),
            "weight_dtype": str(engine.weight_dtype).replace("torch.", ""),
            "cpu_kernels": engine.kernels_label,
            "checkpoint_dtype": str(engine.ckpt.dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(), "ep_ranks": engine.config.parallel.ep_size,
            "weight_bytes": engine.model.weight_bytes(),
            "load_s": engine.load_s, "rows": rows}
