"""``engine compare-hf``: this engine against Hugging Face transformers on one checkpoint, in one run.

Both load the same checkpoint. transformers runs in the checkpoint's dtype (as users run it); the
engine runs twice: in the checkpoint's dtype (same arithmetic) and with ``compute_dtype=auto`` (what
it picks on this machine). For each batch size: prefill tokens/s (the first token's time) and decode
tokens/s (the remaining tokens), the ratio engine/transformers, and the roofline. A second part
replays staggered arrivals: the engine's continuous batching against transformers' static batches.
transformers is a test extra, needed only for this command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from engine.bench import prefill_then_decode
from engine.calibrate import memory_bandwidth_gbps
from engine.config import EngineConfig
from engine.model.maker import resolve_model
from engine.runtime import Engine


class _StepClock:
    """A transformers streamer that records when each generation step emitted its tokens."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _hf_generate(model, prompts: torch.Tensor, new_tokens: int) -> tuple[float, list[float]]:
    """Returns (time to first token, per-step decode times) of one transformers generate call."""
    clock = _StepClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, streamer=clock, pad_token_id=0)
    # times[0] is the prompt being echoed; times[1] the first new token; then one per decode step.
    first = clock.times[1] - t0
    steps = [b - a for a, b in zip(clock.times[1:], clock.times[2:], strict=False)]
    return first, steps


def _engine_generate(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float]]:
    engine.reconfigure(engine.config.replace(
        max_batch_seqs=max(len(prompts), 1), max_batch_tokens=max(4096, len(prompts)),
        prefill_chunk_tokens=4096))
    return prefill_then_decode(engine, prompts, new_tokens)


def compare(model: str, batches: list[int], prompt_len: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    path = resolve_model(model)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype="auto").eval()
    engines = {
        "engine_same_dtype": Engine(path, EngineConfig().replace(compute_dtype="checkpoint")),
        "engine_auto": Engine(path, EngineConfig()),
    }
    if (engines["engine_auto"].dtype, engines["engine_auto"].weight_dtype) == \
            (engines["engine_same_dtype"].dtype, engines["engine_same_dtype"].weight_dtype):
        del engines["engine_auto"]
    bw = memory_bandwidth_gbps()
    spec = engines["engine_same_dtype"].spec
    rows = []
    for b in batches:
        g = torch.Generator().manual_seed(b)
        prompts = torch.randint(3, spec.vocab_size, (b, prompt_len), generator=g)
        runs: dict[str, list[tuple[float, list[float]]]] = {"transformers": []}
        for _ in range(repeats):
            runs["transformers"].append(_hf_generate(hf, prompts, new_tokens))
            for name, eng in engines.items():
                runs.setdefault(name, []).append(_engine_generate(eng, prompts.tolist(), new_tokens))
        row: dict[str, Any] = {"batch": b}
        for name, rs in runs.items():
            row[f"{name}_prefill_tokens_per_s"] = statistics.median(b * prompt_len / f for f, _ in rs)
            row[f"{name}_decode_tokens_per_s"] = statistics.median(b / statistics.median(s) for _, s in rs)
        for name in engines:
            row[f"{name}_decode_x"] = row[f"{name}_decode_tokens_per_s"] / row["transformers_decode_tokens_per_s"]
            row[f"{name}_prefill_x"] = row[f"{name}_prefill_tokens_per_s"] / row["transformers_prefill_tokens_per_s"]
        for name, eng in engines.items():
            dtype_bytes = eng.weight_dtype.itemsize  # the bytes its products read
            touched = eng.model.stats.mean_distinct() or None
            row[f"{name}_roofline_decode_tokens_per_s"] = (
                b * bw * 1e9 / spec.weight_bytes_touched(b, dtype_bytes, touched))
        rows.append(row)
    return {"model": str(path), "arch": spec.arch, "checkpoint_dtype": str(hf.dtype).replace("torch.", ""),
            "engines": {n: str(e.dtype).replace("torch.", "") for n, e in engines.items()},
            "engine_weight_dtypes": {n: str(e.weight_dtype).replace("torch.", "") for n, e in engines.items()},
            "engine_kernels": {n: e.kernels_label for n, e in engines.items()},
            "threads": torch.get_num_threads(), "mem_bw_gb_per_s": bw, "prompt_len": prompt_len,
            "new_tokens": new_tokens, "repeats": repeats, "rows": rows}, hf, engines


def staggered(hf, engine: Engine, n_requests: int, prompt_len: int, new_tokens: int, rate_per_s: float,
              static_batch: int) -> dict[str, Any]:
    """Poisson arrivals: the engine's continuous batching vs transformers' static batches.

    transformers serves a batch when ``static_batch`` requests have arrived (or the last ones) and
    the previous batch is done; a request's tokens all arrive when its batch finishes streaming.
    """
    from engine.runner import run_workload
    from workloads.schema import Request, Workload

    g = torch.Generator().manual_seed(7)
    gaps = torch.empty(n_requests).exponential_(generator=g) / rate_per_s
    arrivals = (torch.cumsum(gaps, 0) - gaps[0]).tolist()
    vocab = engine.spec.vocab_size
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(n_requests)]
    reqs = [Request(str(i), a, prompt_len, new_tokens, prompt_ids=tuple(p))
            for i, (a, p) in enumerate(zip(arrivals, prompts, strict=True))]
    wl = Workload("staggered", reqs, {"source": "engine compare-hf"})
    engine.reconfigure(EngineConfig().replace(compute_dtype=engine.config.runtime.compute_dtype))
    res = run_workload(engine, wl, mode="realtime").summary()
    # transformers, static batches, the same arrivals on the wall clock
    t0 = time.perf_counter()
    ttft, e2e = [], []
    for start in range(0, n_requests, static_batch):
        idx = list(range(start, min(start + static_batch, n_requests)))
        wait = arrivals[idx[-1]] - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        clock = _StepClock()
        with torch.inference_mode():
            batch = torch.tensor([prompts[i] for i in idx])
            hf.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False, streamer=clock, pad_token_id=0)
        first, end = clock.times[1] - t0, clock.times[-1] - t0
        ttft += [(first - arrivals[i]) * 1e3 for i in idx]
        e2e += [(end - arrivals[i]) * 1e3 for i in idx]
    makespan = time.perf_counter() - t0

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]

    return {
        "requests": n_requests, "rate_per_s": rate_per_s, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "static_batch": static_batch,
        "engine": {"ttft_p50_ms": res["ttft_p50_ms"], "ttft_p99_ms": res["ttft_p99_ms"],
                   "e2e_p50_ms": res["e2e_p50_ms"], "e2e_p99_ms": res["e2e_p99_ms"],
                   "output_tokens_per_s": res["output_tokens_per_s"]},
        "transformers_static": {"ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
                                "e2e_p50_ms": pct(e2e, 50), "e2e_p99_ms": pct(e2e, 99),
                                "output_tokens_per_s": n_requests * new_tokens / makespan},
    }


def main(args: argparse.Namespace) -> int:
    batches = [int(b) for b in args.batch.split(",")]
    res, hf, engines = compare(args.model, batches, args.prompt_len, args.new_tokens, args.repeats)
    print(f"model {res['model']} ({res['arch']}, stored {res['checkpoint_dtype']}), prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, {res['threads']} threads, median of {args.repeats}; "
          f"memory read bandwidth {res['mem_bw_gb_per_s']:.1f} GB/s")
    names = ["transformers"] + list(res["engines"])
    for n in res["engines"]:
        print(f"  {n}: {res['engines'][n]} products of {res['engine_weight_dtypes'][n]} weights, "
              f"{res['engine_kernels'][n]} kernels")
    for row in res["rows"]:
        print(f"batch {row['batch']}:")
        for n in names:
            dt = res["checkpoint_dtype"] if n == "transformers" else res["engines"][n]
            extra = "" if n == "transformers" else (f"  ({row[f'{n}_prefill_x']:.2f}x prefill, "
                                                    f"{row[f'{n}_decode_x']:.2f}x decode; roofline "
                                                    f"{row[f'{n}_roofline_decode_tokens_per_s']:.1f} tok/s)")
            print(f"  {n:<18} {dt:<9} prefill {row[f'{n}_prefill_tokens_per_s']:8.1f} tok/s  "
                  f"decode {row[f'{n}_decode_tokens_per_s']:7.1f} tok/s{extra}")
    if args.staggered:
        eng = engines.get("engine_auto") or engines["engine_same_dtype"]
        st = staggered(hf, eng, args.staggered, 64, 32, rate_per_s=2.0, static_batch=8)
        res["staggered"] = st
        print(f"staggered arrivals ({st['requests']} requests, Poisson {st['rate_per_s']}/s, prompt 64, 32 new):")
        for n in ("engine", "transformers_static"):
            s = st[n]
            print(f"  {n:<20} TTFT p50 {s['ttft_p50_ms']:8.0f} ms  p99 {s['ttft_p99_ms']:8.0f} ms   "
                  f"E2E p50 {s['e2e_p50_ms']:8.0f} ms  p99 {s['e2e_p99_ms']:8.0f} ms   "
                  f"{s['output_tokens_per_s']:.1f} tok/s")
    if args.json:
        print(json.dumps(res))
    return 0
