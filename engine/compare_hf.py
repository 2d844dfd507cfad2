"""``engine compare-hf``: this engine against Hugging Face transformers and llama.cpp on one checkpoint.

Every system loads the same checkpoint (llama.cpp from GGUF files written from it, once, into the
cache directory: :mod:`engine.llama_cpp`):

* ``transformers``: transformers in the checkpoint's dtype (as users run it);
* ``engine``: the engine's defaults (on a CPU: the native kernels read the stored bf16/fp16 weights);
* ``engine_torch``: PyTorch's products only (``cpu_kernels=torch``: weights widened to the compute dtype);
* ``engine_checkpoint``: PyTorch's products in the checkpoint's dtype (``compute_dtype=checkpoint``);
* ``engine_int8`` / ``engine_int4``: experts in int8 / int4 (group 128), the rest as ``engine`` (int8 experts
  meet the activations as ``int8_activations=auto`` has it: the faster here of fp32 and int16);
* ``engine_int8_a32`` / ``engine_int8_a16``: int8 experts meeting fp32 activations (``int8_activations=fp32``) /
  activations quantized per block of 32 to int16 (``int16``: int16 dot products, fp32's quality to 4 digits);
* ``engine_int8_a8``: int8 experts meeting activations quantized per block of 32 to int8 (``int8_activations=int8``:
  llama.cpp's q8_0 arithmetic; its quality cost is ``engine eval``'s to measure);
* ``engine_q8``: every matrix in int8 (experts, and the dense ones: ``dense_precision=int8``), as llama.cpp's
  q8_0 stores them;
* ``llama_bf16`` / ``llama_q8_0`` / ``llama_q4_0``: llama.cpp through llama-cpp-python (an optional
  extra: left out, and said so, where it is not installed), in a process of its own, where its OpenMP
  threads wait as they do when users run it (libgomp's default; the engine's process spins 1,000 times
  and sleeps: :class:`engine.llama_cpp.LlamaCppProcess`). Each system records how its threads wait.
  Where llama.cpp dies on its extra buffer types (its AMX weights did, on an AMX Xeon), it runs without
  them and says so (``extra_buffer_types``: :func:`engine.llama_cpp.extra_buffer_types`).

For each batch size B: B prompts are prefilled (prefill tokens/s: the first token's time) and decoded
together (decode tokens/s: the median step), ``repeats`` times. Systems run one at a time (loaded,
measured at every batch size, freed: the machine's memory need not hold them all), and the whole
sequence is repeated ``rounds`` times so that drift shows; the figures are medians over all repeats,
with each round's median kept. Each system's decode has a bandwidth roofline from the bytes it really
reads (its precisions, its KV cache) and, for the engine and transformers, a compute roofline from the
measured peak of its product paths (:mod:`engine.roofline`). A second part replays staggered arrivals:
the engine's continuous batching against transformers' static batches. transformers is a test extra.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.bench import prefill_then_decode
from engine.calibrate import memory_bandwidth_gbps
from engine.config import ConfigError, EngineConfig
from engine.env import cache_dir, huge_pages, omp_wait_policy
from engine.model.maker import resolve_model
from engine.roofline import peak_gflops, roofline, step_cost
from engine.runtime import Engine

log = logging.getLogger(__name__)

ENGINE_SYSTEMS: dict[str, dict[str, Any]] = {
    "engine": {},
    "engine_torch": {"cpu_kernels": "torch"},
    "engine_checkpoint": {"compute_dtype": "checkpoint"},
    "engine_int8": {"hi_precision": "int8"},
    "engine_int8_a8": {"hi_precision": "int8", "int8_activations": "int8"},
    "engine_int8_a16": {"hi_precision": "int8", "int8_activations": "int16"},
    "engine_int8_a32": {"hi_precision": "int8", "int8_activations": "fp32"},
    "engine_int4": {"hi_precision": "int4", "int4_group_size": 128},
    "engine_q8": {"hi_precision": "int8", "dense_precision": "int8"},
}
LLAMA_SYSTEMS = {"llama_bf16": "bf16", "llama_q8_0": "q8_0", "llama_q4_0": "q4_0"}
SYSTEMS = ("transformers", *ENGINE_SYSTEMS, *LLAMA_SYSTEMS)
DEFAULT_SYSTEMS = ("transformers", "engine", "engine_torch", "engine_int8", "engine_int8_a8", "engine_q8", "engine_int4",
                   *LLAMA_SYSTEMS)


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


def gguf_file(model_dir: Path, fingerprint: str, kind: str) -> Path:
    """The GGUF file of ``kind`` for a checkpoint, written into the cache directory on first use."""
    from engine import llama_cpp

    path = cache_dir() / "gguf" / f"{model_dir.name}-{fingerprint[:12]}-{kind}.gguf"
    if not path.exists():
        log.info("writing %s (once)", path)
        tmp = path.with_suffix(".tmp")
        llama_cpp.write_gguf(model_dir, tmp, kind)
        tmp.replace(path)
    return path


class _System:
    """One system loaded for one round: ``run(prompts)`` -> (prefill s, decode step s)."""

    def __init__(self, name: str, path: Path, max_batch: int, ctx_len: int, threads: int):
        self.name = name
        self.engine: Engine | None = None
        self.hf = self.llama = None
        self.gguf: Path | None = None
        t = time.perf_counter()
        if name == "transformers":
            from transformers import AutoModelForCausalLM

            self.hf = AutoModelForCausalLM.from_pretrained(str(path), dtype="auto").eval()
        elif name in ENGINE_SYSTEMS:
            self.engine = Engine(path, EngineConfig().replace(**ENGINE_SYSTEMS[name]))
        else:
            from engine import llama_cpp
            from engine.model.checkpoint import Checkpoint

            self.gguf = gguf_file(path, Checkpoint(path).fingerprint(), LLAMA_SYSTEMS[name])
            extra, self.extra_buffer_types = llama_cpp.extra_buffer_types(self.gguf, max_batch, threads)
            self.llama = llama_cpp.LlamaCppProcess(self.gguf, max_batch, ctx_len, threads,  # its own OpenMP waits
                                                   extra_buffer_types=extra)
        self.load_s = time.perf_counter() - t

    def run(self, prompts: torch.Tensor, new_tokens: int) -> tuple[float, list[float]]:
        if self.hf is not None:
            return _hf_generate(self.hf, prompts, new_tokens)
        if self.engine is not None:
            return _engine_generate(self.engine, prompts.tolist(), new_tokens)
        prefill_s, steps, _ = self.llama.generate(prompts.tolist(), new_tokens)
        return prefill_s, steps

    def describe(self) -> dict[str, Any]:
        if self.engine is not None:
            e = self.engine
            return {"compute_dtype": str(e.dtype).replace("torch.", ""),
                    "weight_dtype": str(e.weight_dtype).replace("torch.", ""),
                    "experts": e.model.hybrid.hi if e.model.hybrid is not None else
                    str(e.weight_dtype).replace("torch.", ""),
                    "int8_activations": e.config.experts.int8_activations,
                    "kv_dtype": str(e.cache.dtype).replace("torch.", ""), "dense": e.model.dense_precision,
                    "cpu_kernels": e.kernels_label, "openmp_waits": omp_wait_policy(), "huge_pages": huge_pages()}
        if self.hf is not None:
            return {"dtype": str(self.hf.dtype).replace("torch.", ""), "transformers": _version("transformers")}
        return {"gguf": str(self.gguf), "llama_cpp_python": _version("llama_cpp_python"),
                "openmp_waits": self.llama.openmp, "extra_buffer_types": self.extra_buffer_types}

    def close(self) -> None:
        if self.llama is not None:
            self.llama.close()
        if self.engine is not None and self.engine.model.hybrid is not None:
            self.engine.model.hybrid.close()
        self.engine = self.hf = self.llama = None
        gc.collect()


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def _roofline(system: _System, spec, batch: int, prompt_len: int, new_tokens: int,
              touched: float | None) -> Callable[[float], dict[str, Any]]:
    """The decode roofline of one system at one batch size, from the bytes it reads, as a function of the
    read bandwidth (GB/s: the best measured through the run, known at its end)."""
    context = prompt_len + new_tokens / 2
    expected = spec.n_experts * (1.0 - (1.0 - spec.top_k / spec.n_experts) ** batch)
    if system.engine is not None:
        cost = step_cost(system.engine, batch, system.engine.model.stats.mean_distinct() or expected, context)
        return lambda bw: roofline(cost, bw)
    if system.gguf is not None:
        from engine import llama_cpp

        g = llama_cpp.gguf_bytes_per_token(system.gguf, spec.n_experts, spec.top_k, touched or expected)
        b = g["bytes_per_step"] + spec.kv_bytes_per_token(2) * batch * context  # llama.cpp's KV cache is f16
        comp = None
    else:  # transformers: bf16 weights and KV cache, bf16 products
        b = spec.weight_bytes_touched(batch, 2, touched or expected) + spec.kv_bytes_per_token(2) * batch * context
        peak = peak_gflops("bf16/torch:bf16")
        flop = 2.0 * spec.active_params_per_token() * batch + 4.0 * spec.q_size * batch * context * spec.n_layers
        comp = batch / (flop / (peak * 1e9)) if peak else None

    def at(bw: float) -> dict[str, Any]:
        bw_tps = batch * bw * 1e9 / b
        return {"bytes_per_step": b, "bandwidth_roofline_tokens_per_s": bw_tps, "compute_roofline_tokens_per_s": comp,
                "roofline_tokens_per_s": min(bw_tps, comp or bw_tps),
                "bound": "compute" if comp and comp < bw_tps else "bandwidth"}

    return at


def _rates(runs: list[tuple[float, list[float]]], batch: int, prompt_len: int) -> tuple[float, float]:
    """(prefill, decode) tokens/s, medians over runs of (prefill seconds, decode step seconds) at ``batch``."""
    return (statistics.median(batch * prompt_len / f for f, _ in runs),
            statistics.median(batch / statistics.median(steps) for _, steps in runs))


def compare(model: str, batches: list[int], prompt_len: int, new_tokens: int, repeats: int, rounds: int = 1,
            systems: tuple[str, ...] = DEFAULT_SYSTEMS,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every system at every batch size; see the module docstring. ``progress`` gets one line per
    system and batch as each is measured (a full comparison takes tens of minutes on a small CPU)."""
    from engine import llama_cpp
    from engine.model.checkpoint import Checkpoint

    path = resolve_model(model)
    spec = Checkpoint(path).spec
    skipped: dict[str, str] = {}
    why = llama_cpp.available()
    if why is not None:
        skipped.update({s: why for s in systems if s in LLAMA_SYSTEMS})
    names = [s for s in systems if s not in skipped]
    # The read bandwidth, measured before the first round and after each: the rooflines take the best, as a
    # single measure taken in a dip of a shared machine made the engine's decode look like 100 % of it.
    bws = [memory_bandwidth_gbps(fresh=True)]
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(3, spec.vocab_size, (b, prompt_len), generator=g) for b in batches}
    runs: dict[str, dict[int, list[list[tuple[float, list[float]]]]]] = {n: {b: [] for b in batches} for n in names}
    info: dict[str, Any] = {}
    touched: dict[int, float] = {}  # the engine's measured distinct experts per layer per step, by batch
    rooflines: dict[str, dict[int, Callable[[float], dict[str, Any]]]] = {n: {} for n in names}
    fused: dict[str, dict[int, float]] = {n: {} for n in names}  # the engine's decode steps run fused, by batch
    later: dict[str, Path | None] = {}  # peers: rooflines once the engine measured the experts touched
    for rnd in range(rounds):
        for name in names:
            try:
                sysm = _System(name, path, max(batches), prompt_len + new_tokens + 8, threads)
            except Exception as e:  # a peer that cannot load this checkpoint: say so, measure the others
                skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.warning("compare: %s left out (%s)", name, skipped[name])
                continue
            info.setdefault(name, {**sysm.describe(), "load_s": []})["load_s"].append(sysm.load_s)
            for b in batches:
                sysm.run(prompts[b][:, : min(prompt_len, 16)], 3)  # warm-up: first-call costs are not speed
                per_round = []
                t0 = time.perf_counter()
                for _ in range(repeats):
                    per_round.append(sysm.run(prompts[b], new_tokens))
                runs[name][b].append(per_round)
                if progress is not None:
                    prefill, decode = _rates(per_round, b, prompt_len)
                    progress(f"round {rnd + 1}/{rounds}, {name}, batch {b}: prefill {prefill:.1f} tok/s, decode "
                             f"{decode:.1f} tok/s ({time.perf_counter() - t0:.0f} s)")
                if sysm.engine is not None:  # the last run's decode steps (stats restart after each prefill)
                    fused[name][b] = sysm.engine.model.stats.fused_steps / max(1, len(per_round[-1][1]))
                if sysm.engine is not None and name == "engine":
                    touched[b] = sysm.engine.model.stats.mean_distinct()
                if rnd == 0 and sysm.engine is not None:  # its bytes come from the loaded model
                    rooflines[name][b] = _roofline(sysm, spec, b, prompt_len, new_tokens, touched.get(b))
            if rnd == 0 and sysm.engine is None:
                later[name] = sysm.gguf
            sysm.close()
            log.info("compare: round %d, %s done", rnd + 1, name)
        bws.append(memory_bandwidth_gbps(fresh=True))
    bw = max(bws)
    for name, gguf in later.items():
        stub = _System.__new__(_System)
        stub.engine, stub.gguf = None, gguf
        for b in batches:
            rooflines[name][b] = _roofline(stub, spec, b, prompt_len, new_tokens, touched.get(b))
    rows = []
    measured = [n for n in names if n not in skipped]
    for b in batches:
        row: dict[str, Any] = {"batch": b}
        for n in measured:
            all_runs = [r for rnd in runs[n][b] for r in rnd]
            if not all_runs:
                continue
            by_round = [_rates(rnd, b, prompt_len) for rnd in runs[n][b]]
            row[f"{n}_prefill_tokens_per_s"], row[f"{n}_decode_tokens_per_s"] = _rates(all_runs, b, prompt_len)
            row[f"{n}_decode_tokens_per_s_rounds"] = [d for _, d in by_round]
            row[f"{n}_prefill_tokens_per_s_rounds"] = [p for p, _ in by_round]
            if b in fused[n]:
                row[f"{n}_decode_steps_fused"] = fused[n][b]
            at = rooflines[n].get(b)
            if at:
                rf = at(bw)
                row[f"{n}_roofline"] = rf
                row[f"{n}_roofline_fraction"] = row[f"{n}_decode_tokens_per_s"] / rf["roofline_tokens_per_s"]
                row[f"{n}_bandwidth_roofline_fraction"] = (row[f"{n}_decode_tokens_per_s"]
                                                           / rf["bandwidth_roofline_tokens_per_s"])
        rows.append(row)
    from engine import kernels

    res = {"model": str(path), "arch": spec.arch, "systems": info, "skipped": skipped, "threads": threads,
           "mem_bw_gb_per_s": bw, "mem_bw_samples_gb_per_s": bws, "prompt_len": prompt_len, "new_tokens": new_tokens,
           "repeats": repeats, "rounds": rounds, "rows": rows, "kernel_dispatch": kernels.dispatch_report()}
    res["targets"] = targets(res)
    return res


def _ratio(row: dict[str, Any], a: str, b: str) -> float | None:
    return row[a] / row[b] if a in row and b in row and row[b] else None


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The CPU-speed targets (issue 14), each with the measured value, the goal and whether it is met."""
    by_batch = {r["batch"]: r for r in res["rows"]}
    out = []

    def add(what: str, value: float | None, goal: float) -> None:
        out.append({"target": what, "value": value, "goal": goal,
                    "met": None if value is None else value >= goal})

    if 1 in by_batch:
        r = by_batch[1]
        add("decode b=1 bf16: fraction of the bandwidth roofline", r.get("engine_bandwidth_roofline_fraction"), 0.85)
        add("decode b=1 bf16: x llama.cpp bf16", _ratio(r, "engine_decode_tokens_per_s", "llama_bf16_decode_tokens_per_s"),
            1.25)
        add("int8 experts b=1: x llama.cpp q8_0", _ratio(r, "engine_int8_decode_tokens_per_s",
                                                         "llama_q8_0_decode_tokens_per_s"), 1.2)
        add("int8 experts, int16 activations b=1: x llama.cpp q8_0",
            _ratio(r, "engine_int8_a16_decode_tokens_per_s", "llama_q8_0_decode_tokens_per_s"), 1.2)
        add("int8 experts, int8 activations b=1: x llama.cpp q8_0",
            _ratio(r, "engine_int8_a8_decode_tokens_per_s", "llama_q8_0_decode_tokens_per_s"), 1.2)
        add("int8 weights (experts and dense) b=1: x llama.cpp q8_0",
            _ratio(r, "engine_q8_decode_tokens_per_s", "llama_q8_0_decode_tokens_per_s"), 1.2)
        add("int4 experts b=1: x int8 experts", _ratio(r, "engine_int4_decode_tokens_per_s",
                                                       "engine_int8_decode_tokens_per_s"), 1.0)
        add("int4 experts b=1: x llama.cpp q4_0", _ratio(r, "engine_int4_decode_tokens_per_s",
                                                         "llama_q4_0_decode_tokens_per_s"), 1.0)
        add("prefill b=1: x transformers bf16", _ratio(r, "engine_prefill_tokens_per_s",
                                                       "transformers_prefill_tokens_per_s"), 2.0)
    big = max(by_batch) if by_batch else None
    if big and big > 1:
        r = by_batch[big]
        add(f"decode b={big} bf16: x llama.cpp bf16", _ratio(r, "engine_decode_tokens_per_s",
                                                            "llama_bf16_decode_tokens_per_s"), 2.5)
        add(f"decode b={big} bf16: fraction of the binding roofline", r.get("engine_roofline_fraction"), 0.6)
        add(f"int8 experts b={big}: x llama.cpp q8_0", _ratio(r, "engine_int8_decode_tokens_per_s",
                                                             "llama_q8_0_decode_tokens_per_s"), 1.2)
    return out


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


def _parse_systems(text: str) -> tuple[str, ...]:
    if text == "default":
        return DEFAULT_SYSTEMS
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in names if s not in SYSTEMS]
    if bad or not names:
        raise ConfigError(f"--systems={text!r}: {bad[0] if bad else 'empty'} is not one of {', '.join(SYSTEMS)}")
    return names


def main(args: argparse.Namespace) -> int:
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        raise ConfigError(f"--batch={args.batch!r}: expected comma-separated integers") from None
    systems = _parse_systems(args.systems)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = compare(args.model, batches, args.prompt_len, args.new_tokens, args.repeats, args.rounds, systems,
                  progress=lambda line: print(f"compare-hf: {line}", file=sys.stderr, flush=True))
    print(f"model {res['model']} ({res['arch']}), prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"{res['threads']} threads, medians of {args.repeats} x {args.rounds} rounds; memory read bandwidth "
          f"{res['mem_bw_gb_per_s']:.1f} GB/s (the best of {len(res['mem_bw_samples_gb_per_s'])} measures, before the "
          f"first round and after each: " + " / ".join(f"{v:.1f}" for v in res['mem_bw_samples_gb_per_s']) + ")")
    for n, d in res["systems"].items():
        print(f"  {n}: " + ", ".join(f"{k} {v}" for k, v in d.items() if k != "load_s"))
    for n, why in res["skipped"].items():
        print(f"  {n}: not measured ({why})")
    for row in res["rows"]:
        print(f"batch {row['batch']}:")
        for n in res["systems"]:
            if f"{n}_decode_tokens_per_s" not in row:
                continue
            rf = row.get(f"{n}_roofline", {})
            comp = rf.get("compute_roofline_tokens_per_s")
            rounds = " / ".join(f"{v:.1f}" for v in row[f"{n}_decode_tokens_per_s_rounds"])
            print(f"  {n:<18} prefill {row[f'{n}_prefill_tokens_per_s']:8.1f} tok/s  decode "
                  f"{row[f'{n}_decode_tokens_per_s']:7.1f} tok/s (rounds {rounds}); roofline: bandwidth "
                  f"{rf.get('bandwidth_roofline_tokens_per_s', float('nan')):.1f}, compute "
                  + (f"{comp:.1f}" if comp else "-")
                  + f" tok/s, {row.get(f'{n}_roofline_fraction', float('nan')):.0%} of the binding one")
    print("targets:")
    for t in res["targets"]:
        v = "-" if t["value"] is None else f"{t['value']:.2f}"
        state = "not measured" if t["met"] is None else ("met" if t["met"] else f"missed by {t['goal'] - t['value']:.2f}")
        print(f"  {t['target']}: {v} (goal {t['goal']}) {state}")
    if args.staggered and "transformers" in systems:
        from transformers import AutoModelForCausalLM

        path = resolve_model(args.model)
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype="auto").eval()
        eng = Engine(path, EngineConfig())
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


def gguf_main(args: argparse.Namespace) -> int:
    """``engine gguf``: write GGUF files of a checkpoint for llama.cpp."""
    from engine import llama_cpp
    from engine.model.checkpoint import Checkpoint

    path = resolve_model(args.model)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in llama_cpp.GGUF_KINDS]
    if bad:
        raise ConfigError(f"--kinds: {bad[0]!r} is not one of {', '.join(llama_cpp.GGUF_KINDS)}")
    out_dir = Path(args.out) if args.out else None
    written = []
    for k in kinds:
        if out_dir is None:
            p = gguf_file(path, Checkpoint(path).fingerprint(), k)
        else:
            p = llama_cpp.write_gguf(path, out_dir / f"{path.name}-{k}.gguf", k)
        written.append({"kind": k, "path": str(p), "bytes": p.stat().st_size})
        print(f"wrote {p} ({p.stat().st_size / 2**20:.0f} MiB, {k})")
    if args.json:
        print(json.dumps({"model": str(path), "files": written}))
    return 0
