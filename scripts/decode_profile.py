"""Where a decode step's time goes: torch.profiler over a few decode steps of one batch, by op.

    python scripts/decode_profile.py --model builtin:qwen3_moe-medium --batch 32 [--steps 10] [--threads 2]
                                     [--python] [--per-op] [--phases]

Loads the engine with its defaults (knobs as ``KEY=VALUE`` after the options, e.g.
``hi_precision=int8``), warms it up with one short `engine bench` batch, prefills ``--batch``
prompts of ``--prompt-len`` random tokens, then profiles ``--steps`` decode steps. Prints the step time,
the decode rate, the kernel paths the engine used and the table of ops by self CPU time; ``--python``
profiles with cProfile instead (Python functions by own time: where the glue between the ops goes).
Decode steps the engine runs fused (every layer in one native call: MoEDecoder._decode_stack) show as one
op; ``--per-op`` runs them op by op, as before the fused step, to see each op; ``--phases`` times more
fused steps by phase, each phase beside the bytes it reads (engine.roofline.phase_bytes), their GB/s and
their fraction of the read bandwidth measured right after: which phase holds a step off its roofline.
On CUDA (``device=cuda``) the profile holds the GPU's kernels too, and one more step runs under PyTorch's
sync debug mode: it prints the implicit host-device synchronisations of a step by call site, and the GPU's
busy time against the step's wall time (a step whose GPU idles waits on its host: launches and syncs).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from engine import calibrate, kernels, roofline
from engine.bench import bench_batch
from engine.config import ConfigError, EngineConfig
from engine.runtime import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:qwen3_moe-medium")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=25, help="ops shown")
    ap.add_argument("--python", action="store_true", help="cProfile (Python functions) instead of torch.profiler")
    ap.add_argument("--per-op", action="store_true", help="decode steps op by op, not fused (see each op)")
    ap.add_argument("--phases", action="store_true",
                    help="also time --steps more fused steps by phase (the fused step's own clocks), each phase with "
                         "the bytes it reads and their rate against the read bandwidth measured after")
    ap.add_argument("knobs", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    knobs = {}
    for kv in args.knobs:
        key, sep, value = kv.partition("=")
        if not sep:
            ap.error(f"knob {kv!r}: expected KEY=VALUE")
        knobs[key] = value
    try:
        config = EngineConfig().replace(**knobs) if knobs else EngineConfig()
    except ConfigError as e:
        ap.error(str(e))
    engine = Engine(args.model, config)
    engine.model.fuse_decode = not args.per_op
    bench_batch(engine, args.batch, args.prompt_len, 4)  # warm-up: sizes the engine for this batch
    g = torch.Generator().manual_seed(1)
    for i in range(args.batch):
        engine.add(f"p{i}", torch.randint(0, engine.spec.vocab_size, (args.prompt_len,), generator=g).tolist(),
                   args.steps * (2 if args.phases else 1) + 1)
    while any(not s.decoding for s in engine.running) or engine.waiting:
        engine.step()
    cuda = engine.device.type == "cuda"
    py = cProfile.Profile() if args.python else None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with py or profile(activities=activities) as prof:
        fused0 = engine.model.stats.fused_steps
        n, t = 0, time.perf_counter()
        while engine.has_work and n < args.steps:
            engine.step()
            n += 1
        step_s = (time.perf_counter() - t) / max(1, n)
    print(f"batch {args.batch}: {n} decode steps, {step_s * 1e3:.1f} ms a step, {args.batch / step_s:.1f} tok/s "
          f"(profiled), {engine.model.stats.fused_steps - fused0} of them fused; kernels {kernels.dispatch_summary()}")
    if py is not None:
        pstats.Stats(py).sort_stats("tottime").print_stats(args.rows)
    else:
        ops = prof.key_averages()
        print(ops.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        if cuda:
            gpu_ms = sum(getattr(e, "self_device_time_total", 0) for e in ops) / 1e3 / max(1, n)
            launches = sum(e.count for e in ops if "LaunchKernel" in e.key) / max(1, n)
            print(f"GPU busy {gpu_ms:.2f} ms of a {step_s * 1e3:.2f} ms step; {launches:.0f} kernel launches a step")
    if args.phases:
        print_phases(engine, args.batch, args.steps)
    if cuda and engine.has_work:
        print_syncs(engine)


def print_phases(engine: Engine, batch: int, steps: int) -> None:
    """``steps`` more decode steps, unprofiled, timed by the fused step's phases (DecodeStack.set_timing):
    ms a step per phase and what the step spends outside the fused call (lm head, sampling, Python), each
    with the bytes it reads (engine.roofline.phase_bytes) and their rate against the read bandwidth measured
    right after (engine.calibrate: what the rooflines divide by), so that each phase's distance from its
    bound shows."""
    stack = engine.model._stack[1] if engine.model._stack is not None else None
    if stack is None:
        print("phases: no fused step ran (per-op path); see the profile above")
        return
    stats = engine.model.stats
    windowed = engine.spec.sliding_window or float("inf")

    def cached() -> float:  # positions the next step's attention reads (its own row included)
        return sum(min(s.cached_len + 1, windowed) for s in engine.running if s.decoding)

    stack.set_timing(True)
    experts0, context, n, total_s = stats.distinct_experts, 0, 0, 0.0
    while engine.has_work and n < steps:
        context += cached()  # counted between the timed steps
        t = time.perf_counter()
        engine.step()
        total_s += time.perf_counter() - t
        n += 1
    step_s = total_s / max(1, n)
    names, seconds, timed = stack.phase_seconds()
    stack.set_timing(False)
    read_gbps = calibrate.memory_bandwidth_gbps(fresh=True)
    nbytes = roofline.phase_bytes(engine, (stats.distinct_experts - experts0) / max(1, n), context / max(1, n))
    fused_ms = sum(seconds) * 1e3 / max(1, timed)
    print(f"phases of {timed} fused steps at batch {batch}: {step_s * 1e3:.2f} ms a step "
          f"({batch / step_s:.1f} tok/s), {fused_ms:.2f} in the fused call; read bandwidth {read_gbps:.1f} GB/s "
          f"(measured after)")

    def line(name: str, ms: float, note: str = "") -> None:
        mb = nbytes.get(name, 0.0) / 1e6
        rate = f"{mb / ms:7.1f} GB/s  {mb / ms / read_gbps:4.2f} of it" if ms > 0 and mb >= 0.5 else ""
        print(f"  {name:12s} {ms:8.3f} ms {mb:8.1f} MB {rate}{note}")

    for name, sec in sorted(zip(names, seconds, strict=True), key=lambda p: -p[1]):
        if sec > 0:
            line(name, sec * 1e3 / max(1, timed))
    if timed == n:  # every step fused: the rest of a step is outside the call
        line("outside", step_s * 1e3 - fused_ms, "  (lm head, sampling, Python)")
        total_mb = sum(nbytes.values()) / 1e6
        print(f"  {'step':12s} {step_s * 1e3:8.3f} ms {total_mb:8.1f} MB {total_mb / step_s / 1e3:7.1f} GB/s  "
              f"{total_mb / step_s / 1e3 / read_gbps:4.2f} of it (the bandwidth roofline's fraction)")
    else:
        print(f"  ({n - timed} of the {n} steps ran op by op: no time outside the call to show)")


def print_syncs(engine: Engine) -> None:
    """The implicit host-device synchronisations of one decode step, by the line that caused them."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    sites = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught)
    print(f"implicit syncs in one step: {sum(sites.values())}")
    for site, count in sites.most_common(12):
        print(f"  {count:4d}  {site}")


if __name__ == "__main__":
    main()
