"""``engine``: check the machine, make models, generate, replay workloads, serve the OpenAI API, benchmark,
list knobs.

Every measuring command takes ``--json``: a readable table first, then one JSON object as the last
line of stdout. Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from engine.backend import BACKENDS
from engine.config import ConfigError, EngineConfig, add_cli_args, config_from_args, knob_table
from engine.model.arch import ARCHS, CheckpointError
from engine.model.maker import DEFAULT_ROUTER_SKEW, PRESETS

DEFAULT_MODEL = "builtin:qwen3_moe-small"
DEFAULT_WORKLOAD = "builtin:chat"


def _limits_line(limits: dict) -> str:
    """The measured limits a bench row's rooflines divide by, in words."""
    if limits["device"] == "cpu":
        return f"memory read bandwidth {limits['read_gbps']:.1f} GB/s"
    peaks = ", ".join(f"{k} {v / 1e3:.0f}" for k, v in (limits.get("device_peak_gflops") or {}).items())
    return (f"{limits['device']} memory read {limits['read_gbps']:.0f} GB/s, host memory "
            f"{limits['host_read_gbps']:.1f} GB/s, host link {limits['link_gbps']:.1f} GB/s, "
            f"matrix peaks (TFLOP/s) {peaks}")


def _table(rows: list[dict[str, Any]], cols: list[str], fmt: dict[str, str] | None = None) -> str:
    fmt = fmt or {}

    def cell(row: dict[str, Any], c: str) -> str:
        v = row.get(c)
        if v is None:
            return "-"
        if c in fmt and isinstance(v, (int, float)):
            return format(v, fmt[c])
        return str(v)

    cells = [[cell(r, c) for c in cols] for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    base = EngineConfig.from_file(args.config) if getattr(args, "config", None) else None
    return config_from_args(args, base)


def _load_engine(args: argparse.Namespace):
    from engine.runtime import Engine

    cfg = _engine_config(args)
    if getattr(args, "config", None):
        _warn_if_tuned_elsewhere(args.config, args.model)
    return Engine(args.model, cfg)


def _warn_if_tuned_elsewhere(path: str, model: str) -> None:
    """An exported tuner config names the model and hardware it was tuned for; say when they differ."""
    from engine.hwinfo import hardware
    from engine.model.checkpoint import Checkpoint
    from engine.model.maker import resolve_model

    with open(path) as fh:
        data = json.load(fh)
    if not isinstance(data, dict) or "engine_config" not in data:
        return
    tuned_model = (data.get("model") or {}).get("fingerprint")
    if tuned_model and tuned_model != Checkpoint(resolve_model(model)).fingerprint():
        print(f"engine: warning: {path} was tuned for another model ({(data.get('model') or {}).get('path')})",
              file=sys.stderr)
    tuned_hw = (data.get("hardware") or {}).get("fingerprint")
    if tuned_hw and tuned_hw != hardware()["fingerprint"]:
        print(f"engine: warning: {path} was tuned on other hardware "
              f"({(data.get('hardware') or {}).get('cpu_model')})", file=sys.stderr)


def _provenance(engine) -> dict[str, Any]:
    """Which machine, software and path produced a result: added to every ``--json`` object."""
    from engine.hwinfo import hardware, software

    return {"hardware": hardware(), "software": software(), "device": str(engine.device),
            "compute_dtype": str(engine.dtype).replace("torch.", ""),
            "weight_dtype": str(engine.weight_dtype).replace("torch.", ""), "cpu_kernels": engine.kernels_label,
            "experts": engine.model.hybrid.hi if engine.model.hybrid is not None else
            str(engine.weight_dtype).replace("torch.", ""),
            "kv_dtype": str(engine.cache.dtype).replace("torch.", ""), "dense": engine.model.dense_precision,
            "ep_ranks": engine.config.parallel.ep_size, "config_hash": engine.config.config_hash()}


def cmd_doctor(args: argparse.Namespace) -> int:
    from engine.doctor import diagnose, format_report

    report = diagnose()
    print(format_report(report))
    if args.json:
        print(json.dumps(report))
    return 1 if report["problems"] else 0


def cmd_make_model(args: argparse.Namespace) -> int:
    from engine.model.maker import make_model

    made = make_model(args.out, args.arch, args.preset, seed=args.seed, dtype=args.dtype,
                      router_skew=args.router_skew)
    print(f"wrote {made.path}: {args.arch}-{args.preset}, {made.params / 1e6:.1f}M params, "
          f"{made.bytes / 2**20:.0f} MiB ({args.dtype})")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    try:
        prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--prompt-ids={args.prompt_ids!r}: expected comma-separated integers") from None
    engine = _load_engine(args)
    import time

    t = time.perf_counter()
    out = engine.generate([prompt], args.max_new_tokens)[0]
    dt = time.perf_counter() - t
    print(" ".join(map(str, out)))
    if args.json:
        print(json.dumps({"prompt_ids": prompt, "output_ids": out, "seconds": dt, **_provenance(engine)}))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine.backend import make_backend
    from engine.metrics import PERCENTILES, latency_name
    from engine.runner import popularity, run_workload
    from workloads.schema import load_workload

    workload = load_workload(args.workload)
    cfg = _engine_config(args)
    if getattr(args, "config", None):
        _warn_if_tuned_elsewhere(args.config, args.model)
    backend = make_backend(args.model, cfg, kind=args.backend, **backend_options(args))
    total = min(len(workload.requests), args.max_requests or len(workload.requests))
    with tqdm(total=total, desc="requests", unit="req", disable=args.quiet or not sys.stderr.isatty()) as bar:
        def on_step(done: int, _total: int) -> None:
            bar.update(done - bar.n)

        result = run_workload(backend, workload, mode=args.mode, rate_scale=args.rate_scale,
                              max_requests=args.max_requests, on_step=on_step, decisions=bool(args.decisions))
    s = result.summary()
    meta = result.meta
    if meta["backend"] == "live":
        ran = f"{meta['compute_dtype']} on {meta['device']}"
    elif meta["backend"] == "sim":
        prof = meta["profile"]
        ran = (f"simulated on profile {prof['name']} ({'calibrated' if prof['calibrated'] else 'calibrated: false'}), "
               f"{meta['compute_dtype']} on {meta['device']}, virtual clock")
    else:
        ran = f"{meta['backend']} backend: plans only, no tensors, steps unpriced"
    print(f"model {meta['model']['path']} ({meta['model']['arch']}, {ran}); workload {workload.name} ({args.mode}); "
          f"{s['requests_done']}/{s['requests']} requests in {s['duration_s']:.1f}s")
    rows = [{"metric": f"{m}_ms", **{f"p{q}": s.get(latency_name(m, q)) for q in PERCENTILES},
             "mean": s.get(latency_name(m))} for m in ("ttft", "tpot", "itl", "e2e")]
    print(_table(rows, ["metric", "p50", "p90", "p99", "mean"], {c: ".1f" for c in ("p50", "p90", "p99", "mean")}))
    print(f"output {s['output_tokens_per_s']:.1f} tok/s, {s['requests_per_s']:.2f} req/s, "
          f"{s['steps']} steps, peak RSS {s['peak_rss_bytes'] / 2**30:.2f} GiB")
    ep = meta.get("ep")
    if ep:  # live ranks or simulated ones: the same record
        print(f"expert parallelism: {ep['ranks']} ranks, {ep['placement']['policy']} placement; tokens per rank "
              f"{ep['tokens_per_rank']}; imbalance (max/mean per layer) {ep['imbalance_mean']:.3f} mean, "
              f"{ep['imbalance_max']:.3f} max; per step {ep['bytes_dispatched_per_step_mean'] / 1e6:.2f} MB "
              f"dispatched, {ep['bytes_combined_per_step_mean'] / 1e6:.2f} MB combined")
    from engine.roofline import machine_limits, run_roofline

    live = getattr(backend, "engine", None)  # the stub backend runs no tensors: no roofline
    roof = run_roofline(live, result, machine_limits(live.device)) if live is not None else None
    if roof is not None:
        comp = roof["compute_roofline_tokens_per_s"]
        print(f"decode steps (median batch {roof['median_decode_batch']}): {roof['decode_tokens_per_s']:.1f} tok/s; "
              f"roofline {roof['roofline_tokens_per_s']:.1f} ({roof['bound']}-bound: bandwidth "
              f"{roof['bandwidth_roofline_tokens_per_s']:.1f}, compute " + (f"{comp:.1f}" if comp else "-")
              + f"), {roof['roofline_fraction']:.0%} of it; {roof['bytes_per_step'] / 1e6:.0f} MB per step")
    pop = popularity(result)
    if args.popularity:
        print(_table(pop, ["layer", "tokens", "top10pct_share", "entropy_norm", "hottest"],
                     {"top10pct_share": ".2f", "entropy_norm": ".3f"}))
    if args.decisions:
        with open(args.decisions, "w") as fh:
            for entry in result.decisions or []:
                fh.write(json.dumps(entry, separators=(",", ":")) + "\n")
        print(f"wrote {len(result.decisions or [])} decisions to {args.decisions}")
    full = result.to_dict()
    full["popularity"] = pop
    full["roofline"] = roof
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(full, fh)
        print(f"wrote {args.out}")
    if args.json:
        print(json.dumps(full))
    return 0


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """What ``make_backend`` takes besides the model and config, from ``--profile`` and the synthetic
    routing flags (the sim backend's; refused with another backend)."""
    kind = getattr(args, "backend", "live")
    profile = getattr(args, "profile", None)
    routing_given = any(getattr(args, f, None) is not None for f in ("router_skew", "router_drift"))
    if kind != "sim":
        if profile is not None or routing_given:
            raise ConfigError(f"--profile/--router-skew/--router-drift price or route a simulated run; "
                              f"they need --backend sim (got --backend {kind})")
        return {}
    if profile is None:
        raise ConfigError("--backend sim needs --profile FILE (from `engine calibrate`) or builtin:<name>")
    from engine.sim.profile import load_profile
    from engine.sim.routes import SyntheticRouting

    defaults = SyntheticRouting()
    routing = SyntheticRouting(skew=defaults.skew if args.router_skew is None else args.router_skew,
                               drift=defaults.drift if args.router_drift is None else args.router_drift)
    return {"profile": load_profile(profile), "routing": routing}


def sim_args(sp: argparse.ArgumentParser) -> None:
    """``--backend``, ``--profile`` and the synthetic routing flags of a command that runs a workload."""
    from engine.sim.profile import BUILTIN
    from engine.sim.routes import SyntheticRouting

    d = SyntheticRouting()
    sp.add_argument("--backend", choices=BACKENDS, default="live",
                    help="live: the torch engine; stub: the same scheduler and plans routed from the workload's "
                         "router trace, with no tensors (steps take 0 s); sim: the stub's plans priced by --profile "
                         "on a virtual clock (--model may be shape:<name> or a directory holding only config.json)")
    sp.add_argument("--profile", help="sim: a profile file from `engine calibrate`, or builtin:<name> "
                    f"(datasheet, uncalibrated: {', '.join(BUILTIN)}; <gpu>+<host> pairs them)")
    sp.add_argument("--router-skew", type=float, default=None,
                    help=f"sim without a router trace: Zipf exponent of synthetic expert popularity "
                         f"(default {d.skew:g})")
    sp.add_argument("--router-drift", type=float, default=None,
                    help=f"sim without a router trace: share of each layer's experts whose popularity moves per "
                         f"{d.drift_window_tokens} tokens (default {d.drift:g})")


def cmd_calibrate(args: argparse.Namespace) -> int:
    import time

    from engine.sim.calibrate import calibrate

    t0 = time.perf_counter()
    steps = [0]

    def progress(msg: str) -> None:
        steps[0] += 1
        print(f"calibrate [{steps[0]:2d}] {time.perf_counter() - t0:6.1f}s  {msg}", file=sys.stderr, flush=True)

    prof = calibrate(progress, model=args.model, name=args.name)
    prof.save(args.out)
    h = prof.host
    rows = [{"what": k, "value": v} for k, v in (
        ("host", h.name), ("memory bandwidth GB/s", f"{h.mem_bw_bytes_per_s / 1e9:.1f}"),
        ("fp32 GEMM GFLOP/s", f"{h.peak_flops['fp32'] / 1e9:.1f}"),
        ("threads", h.threads), ("auto compute dtype", prof.measured.get("auto_compute_dtype")),
        ("layer overhead us", f"{h.layer_overhead_s * 1e6:.1f}"), ("token overhead us", f"{h.token_overhead_s * 1e6:.1f}"),
        ("hybrid MoE layer overhead us", f"{h.moe_layer_overhead_s * 1e6:.1f}"),
        ("device", prof.device.name if prof.device else "none (host-only profile)"),
        ("tables", len(h.tables)), ("seconds", prof.measured.get("seconds")))]
    print(_table(rows, ["what", "value"]))
    print(f"wrote {args.out} (calibrated: true)")
    if args.json:
        print(json.dumps({"out": args.out, "profile": prof.describe(), "measured": prof.measured}))
    return 0


def cmd_validate_sim(args: argparse.Namespace) -> int:
    import os
    import time

    from engine.sim.profile import load_profile
    from engine.sim.validate import METRICS, validate
    from workloads.schema import load_workload

    prof = load_profile(args.profile)
    workload = load_workload(args.workload)
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"validate-sim {time.perf_counter() - t0:6.1f}s  {msg}", file=sys.stderr, flush=True)

    load_before = os.getloadavg()
    res = validate(args.model, workload, prof, args.configs, seed=args.seed, mode=args.mode,
                   max_requests=args.max_requests or None, progress=progress, grid=args.grid)
    res["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
    print(f"model {args.model}; workload {workload.name} ({args.mode}, {args.max_requests or 'all'} requests); "
          f"profile {prof.name} (calibrated: {str(prof.calibrated).lower()}); {res['configs']} configs; "
          f"load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    short = {"output_tokens_per_s": "tok/s", "tpot_p99_ms": "p99 TPOT ms", "ttft_p99_ms": "p99 TTFT ms",
             "tpot_p50_ms": "p50 TPOT ms"}
    rows = []
    for i, r in enumerate(res["rows"]):
        row: dict[str, Any] = {"#": i + 1}
        for m in METRICS[:3]:
            row[f"{short[m]} live"] = r["live"][m]
            row[f"{short[m]} sim"] = r["sim"][m]
            row[f"{short[m]} err"] = None if r["error"][m] is None else f"{100 * r['error'][m]:+.0f}%"
        rows.append(row)
    cols = ["#"] + [f"{short[m]} {w}" for m in METRICS[:3] for w in ("live", "sim", "err")]
    print(_table(rows, cols, {c: ".1f" for c in cols if c.endswith(("live", "sim"))}))
    summ = [{"metric": short[m], "median |error|": None if v["median_abs_error"] is None
             else f"{100 * v['median_abs_error']:.1f}%",
             "target": None if v["target"] is None else f"<= {100 * v['target']:.0f}%",
             "met": v["met"]} for m, v in ((m, res["summary"][m]) for m in METRICS)]
    sp = res["summary"]["spearman_output_tokens_per_s"]
    summ.append({"metric": "Spearman rho (tok/s ranks)", "median |error|": None if sp["rho"] is None
                 else f"{sp['rho']:.2f}", "target": f">= {sp['target']}", "met": sp["met"]})
    print(_table(summ, ["metric", "median |error|", "target", "met"]))
    for i, r in enumerate(res["rows"]):
        print(f"  #{i + 1}: {r['config'] or 'defaults'}")
    if args.json:
        print(json.dumps(res))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import time
    from datetime import UTC, datetime

    from engine.sim.plan import plan
    from engine.sim.profile import load_profile
    from workloads.schema import load_workload

    profiles = [load_profile(p) for p in args.profile]
    workload = load_workload(args.workload)
    base = _engine_config(args)
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"plan {time.perf_counter() - t0:6.1f}s  {msg}", file=sys.stderr, flush=True)

    from tuner.slo import DEFAULT_SLO, SloError, parse_slo

    try:
        slo = parse_slo(args.slo) if args.slo else parse_slo(
            data={k: v for k, v in DEFAULT_SLO.items() if not k.startswith("quality")})
    except SloError as e:
        raise ConfigError(str(e)) from None
    if slo.attainment_target is None:
        raise ConfigError(f"--slo {' '.join(args.slo)}: capacity needs a per-request latency bound "
                          "(ttft_p99_ms, tpot_p99_ms or e2e_p99_ms)")
    if args.no_db and args.db:
        raise ConfigError(f"--db {args.db!r} with --no-db: pick one")
    db = None
    if not args.no_db:  # a bad URL or an unreachable server stops here, before any pricing
        from db.session import make_engine, resolve_url, upgrade

        url = resolve_url(args.db)
        upgrade(url)
        db = make_engine(url)
    started_at = datetime.now(UTC)
    rows = plan(args.model, profiles, workload, base, max_requests=args.max_requests or None, progress=progress,
                slo=slo)
    wall_s = time.perf_counter() - t0
    n = min(len(workload.requests), args.max_requests or len(workload.requests))
    bounds = ", ".join(f"{k}={v:g}" for k, v in slo.bounds.items())
    print(f"model {args.model}; workload {workload.name} ({n} requests); SLO {bounds}, attainment "
          f"{100 * slo.attainment_target:.0f} %; simulated, {wall_s:.1f} s")
    for prof in profiles:
        mine = [r for r in rows if r["profile"] == prof.name]
        print(f"\n{prof.name}: {prof.fast.name} + {prof.host.name} (calibrated: {str(prof.calibrated).lower()})")
        print(_table(mine, ["budget_gib", "hi", "missing", "batching", "replicas", "offline_tokens_per_s",
                            "ttft_p99_ms", "tpot_p99_ms", "capacity_rps", "error"],
                     {"offline_tokens_per_s": ".1f", "ttft_p99_ms": ".0f", "tpot_p99_ms": ".1f",
                      "capacity_rps": ".2f", "budget_gib": ".1f"}))
    described = [{**p.describe(), "fast": p.fast.name} for p in profiles]
    plan_id = None
    if db is not None:
        from db.session import mask_url, session_scope
        from db.store import add_plan
        from engine.backend_sim import sim_software

        try:
            with session_scope(db) as s:
                plan_id = add_plan(s, model=args.model, workload=workload.name, workload_source=args.workload,
                                   n_requests=n, slo={**slo.to_dict(), "attainment_min": slo.attainment_target},
                                   profiles=described, base_config=base.to_dict(), software=sim_software(),
                                   wall_s=wall_s, rows=rows, created_at=started_at)
        finally:
            db.dispose()
        print(f"\nstored as plan {plan_id} in {mask_url(db.url)} (dashboard: the Plans page)")
    if args.json:
        print(json.dumps({"model": args.model, "workload": workload.name, "rows": rows, "profiles": described,
                          "plan_id": plan_id}))
    return 0


def _bench_sim(args: argparse.Namespace, batches: list[int]) -> int:
    from engine.backend import make_backend
    from engine.sim.bench import sim_bench

    if args.backend != "sim":
        raise ConfigError(f"engine bench --backend {args.backend}: bench runs live or sim (the stub prices nothing)")
    backend = make_backend(args.model, _engine_config(args), kind="sim", **backend_options(args))
    res = sim_bench(backend, batches, args.prompt_len, args.new_tokens)
    prof = res["profile"]
    print(f"model {res['model']}: simulated on profile {prof['name']} (calibrated: {str(prof['calibrated']).lower()}), "
          f"{res['compute_dtype']} on {res['device']}; prompt {args.prompt_len}, {args.new_tokens} new tokens")
    print(_table(res["rows"], ["batch", "prefill_tokens_per_s", "decode_tokens_per_s", "decode_step_ms"],
                 {"prefill_tokens_per_s": ".1f", "decode_tokens_per_s": ".1f", "decode_step_ms": ".2f"}))
    if args.json:
        print(json.dumps(res))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from engine.bench import run_bench

    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        raise ConfigError(f"--batch={args.batch!r}: expected comma-separated integers") from None
    if args.backend != "live":
        return _bench_sim(args, batches)
    backend_options(args)  # refuses --profile and the routing flags without --backend sim
    engine = _load_engine(args)
    res = run_bench(engine, batches, args.prompt_len, args.new_tokens, repeats=args.repeats)
    print(f"model {res['model']} ({res['arch']}): weights {res['weight_bytes'] / 2**30:.2f} GiB in "
          f"{res['weight_dtype']} (stored {res['checkpoint_dtype']}), {res['compute_dtype']} products by "
          f"{res['cpu_kernels']} kernels on {res['device']}, {res['threads']} threads"
          + (f" per rank, {res['ep_ranks']} expert-parallel ranks (weights: rank 0's share)"
             if res["ep_ranks"] > 1 else "")
          + f"; prompt {args.prompt_len}, {args.new_tokens} new tokens, median of {args.repeats}")
    print(_table(res["rows"], ["batch", "prefill_tokens_per_s", "roofline_prefill_tokens_per_s", "decode_tokens_per_s",
                               "bandwidth_roofline_decode_tokens_per_s", "compute_roofline_decode_tokens_per_s",
                               "roofline_bound", "roofline_fraction", "achieved_gb_per_s", "achieved_gflop_per_s",
                               "decode_experts_touched_per_layer"],
                 {"prefill_tokens_per_s": ".1f", "roofline_prefill_tokens_per_s": ".1f", "decode_tokens_per_s": ".1f",
                  "bandwidth_roofline_decode_tokens_per_s": ".1f", "compute_roofline_decode_tokens_per_s": ".1f",
                  "roofline_fraction": ".2f", "achieved_gb_per_s": ".1f", "achieved_gflop_per_s": ".1f",
                  "decode_experts_touched_per_layer": ".1f"}))
    row = res["rows"][-1]
    print(f"{_limits_line(row['limits'])}; decode products: dense "
          f"{row['decode_paths']['dense']}, experts {row['decode_paths']['experts']}, "
          f"routers {row['decode_paths']['router']}; "
          f"{row['bytes_per_decode_step'] / 1e6:.0f} MB and {row['flop_per_decode_step'] / 1e9:.2f} GFLOP per step "
          f"at batch {row['batch']} (KV cache {row['kv_bytes_per_decode_step'] / 1e6:.1f} MB, {res['kv_dtype']})")
    if res["ep_ranks"] > 1:  # decode steps: pairs per rank, max/mean per layer, combine bytes per step
        print(_table(res["rows"], ["batch", "ep_tokens_per_rank", "ep_imbalance", "ep_step_imbalance",
                                   "ep_bytes_combined_per_step"],
                     {"ep_imbalance": ".3f", "ep_step_imbalance": ".3f", "ep_bytes_combined_per_step": ".0f"}))
    if args.json:
        print(json.dumps({**res, "provenance": _provenance(engine)}))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from engine.quality import evaluate, synthetic_prompts

    engine = _load_engine(args)
    if args.prompts:
        from workloads.schema import load_workload

        wl = load_workload(args.prompts)
        prompts = [r.prompt_token_ids(engine.spec.vocab_size, engine.config.runtime.seed)
                   for r in wl.requests[: args.max_prompts]]
    else:
        prompts = synthetic_prompts(engine.spec.vocab_size, n=args.max_prompts, seed=engine.config.runtime.seed)
    if args.llama:
        if args.text:
            raise ConfigError("eval: --text (perplexity) is measured for the engine's configs, not with --llama")
        from engine.quality import evaluate_llama

        res = evaluate_llama(engine, args.llama, prompts)
        print(f"quality of llama.cpp on {res['gguf']} ({args.llama}) against {engine.model_path}'s fp32 reference "
              f"({res['prompts']} prompts, {res['positions']} positions):")
        print(f"  next-token top-1 agreement {res['top1_agreement']:.4f}   mean KL {res['mean_kl']:.3e}   "
              f"(llama.cpp's extra buffer types {res['extra_buffer_types']})")
        if args.json:
            print(json.dumps({**res, "provenance": {"system": "llama.cpp", "gguf": args.llama,
                                                    "extra_buffer_types": res["extra_buffer_types"]}}))
        return 0
    res = evaluate(engine, prompts, text_file=args.text)
    res["config_hash"] = engine.config.config_hash()
    print(f"quality of {engine.model_path} with config {res['config_hash']} against its fp32 reference "
          f"({res['prompts']} prompts, {res['positions']} positions):")
    print(f"  next-token top-1 agreement {res['top1_agreement']:.4f}   mean KL {res['mean_kl']:.3e}"
          + (f"   perplexity {res['perplexity']:.2f} (reference {res['reference_perplexity']:.2f})"
             if "perplexity" in res else ""))
    if args.json:
        print(json.dumps({**res, "provenance": _provenance(engine)}))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from engine.sweep import default_sweep, run_sweep

    engine = _load_engine(args)
    sweep = default_sweep(engine)
    if args.knobs:
        unknown = [k for k in args.knobs.split(",") if k not in sweep]
        if unknown:
            raise ConfigError(f"--knobs: {unknown[0]!r} is not swept (choose from {', '.join(sweep)})")
        sweep = {k: sweep[k] for k in args.knobs.split(",")}
    res = run_sweep(engine, sweep, args.batch, args.prompt_len, args.new_tokens, args.repeats, args.quality_prompts)
    print(f"model {res['model']} ({res['compute_dtype']} products of {res['weight_dtype']} weights, "
          f"{res['cpu_kernels']} kernels), batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, median of {args.repeats}; quality vs the fp32 reference")
    print(_table(res["rows"], ["knob", "value", "prefill_tokens_per_s", "decode_tokens_per_s", "peak_rss_gib",
                               "fast_tier_expert_gib", "bytes_to_fast", "host_expert_calls", "top1_agreement",
                               "mean_kl", "error"],
                 {"prefill_tokens_per_s": ".1f", "decode_tokens_per_s": ".1f", "peak_rss_gib": ".2f",
                  "fast_tier_expert_gib": ".3f", "top1_agreement": ".3f", "mean_kl": ".2e"}))
    if args.json:
        print(json.dumps({**res, "provenance": _provenance(engine)}))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import ipaddress

    from engine.env import api_key as env_api_key
    from engine.serve.app import bind_socket, lower_this_thread, make_server, uvicorn_server
    from engine.serve.config import serve_config_from_args

    settings = serve_config_from_args(args)
    key = args.api_key or env_api_key()
    engine = _load_engine(args)
    name = settings.served_model_name or args.model
    server = make_server(engine, settings, name, key)
    sock = bind_socket(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    text = ("text and token ids" if server.text is not None else "token ids only (no tokenizer.json)")
    print(f"engine: serving {name} ({engine.spec.arch}, {str(engine.dtype).replace('torch.', '')} on "
          f"{engine.device}) with config {engine.config.config_hash()}"
          + (f" from {args.config}" if args.config else " (defaults and flags)")
          + f"; {text}; http://{host if ':' not in host else f'[{host}]'}:{port}/v1", flush=True)
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not key:
        print(f"engine: warning: listening on {host} without an API key (--api-key or MOETUNE_API_KEY)",
              file=sys.stderr)
    server.loop.start()  # its thread, and the compute threads it starts, keep this thread's priority
    lower_this_thread(settings.http_thread_nice)  # then HTTP (this thread) yields to engine steps
    try:
        uvicorn_server(server.app(), settings).run(sockets=[sock])
    finally:
        server.loop.close()
        sock.close()
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from engine.serve.bench import format_bench, run_bench_serve

    if args.config:
        _warn_if_tuned_elsewhere(args.config, args.model)
    res = run_bench_serve(args.model, _engine_config(args), args.workload, mode=args.mode, rate_scale=args.rate_scale,
                          max_requests=args.max_requests or None, repeats=args.repeats,
                          warmup_rounds=args.warmup_rounds, inprocess_thread=args.inprocess_thread, client_nice=args.client_nice,
                          server_args=["--http-thread-nice", str(args.http_thread_nice)]
                          if args.http_thread_nice is not None else None)
    print(format_bench(res))
    if args.json:
        print(json.dumps(res))
    return 0


def cmd_knobs(args: argparse.Namespace) -> int:
    rows = knob_table()
    if args.json:
        print(json.dumps(rows))
        return 0
    print(_table(rows, ["knob", "default", "range", "search", "doc"]))
    return 0


def cmd_compare_hf(args: argparse.Namespace) -> int:
    from engine.compare_hf import main as compare_main

    return compare_main(args)


def cmd_gguf(args: argparse.Namespace) -> int:
    from engine.compare_hf import gguf_main

    return gguf_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engine", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("doctor", help="what this machine gives the engine: ISA, kernels, dtype, CUDA, NVML "
                                      "(exit 1 when something is broken)")
    d.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    d.set_defaults(fn=cmd_doctor)

    m = sub.add_parser("make-model", help="write a random-weight checkpoint in the Hugging Face layout")
    m.add_argument("--arch", required=True, choices=ARCHS)
    m.add_argument("--preset", default="tiny", choices=PRESETS)
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    m.add_argument("--router-skew", type=float, default=DEFAULT_ROUTER_SKEW,
                   help="how heavy-tailed expert popularity is (0 = uniform random routers)")
    m.set_defaults(fn=cmd_make_model)

    def model_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory or builtin:<arch>-<preset> (sim: also shape:<name>, or a directory holding only config.json)")
        sp.add_argument("--config", help="engine config JSON (or a `tuner export` file)")
        sp.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
        sp.add_argument("--ep", dest="knob__ep_size", metavar="N",
                        help="expert parallelism over N ranks (processes; one GPU each on CUDA): the same as "
                             "--ep-size")
        add_cli_args(sp)

    g = sub.add_parser("generate", help="generate tokens for one prompt")
    g.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    g.add_argument("--max-new-tokens", type=int, default=16)
    model_args(g)
    g.set_defaults(fn=cmd_generate)

    r = sub.add_parser("run", help="replay a workload and measure every request")
    r.add_argument("--workload", default=DEFAULT_WORKLOAD, help="workload path or builtin:<name>")
    r.add_argument("--mode", choices=["realtime", "offline"], default="realtime")
    r.add_argument("--rate-scale", type=float, default=1.0, help="divide arrival times by this")
    r.add_argument("--max-requests", type=int, default=None)
    r.add_argument("--popularity", action="store_true", help="print the expert popularity seen per layer")
    r.add_argument("--out", help="write the full result JSON here")
    r.add_argument("--decisions", metavar="OUT.jsonl",
                   help="write the expert plan of every step and MoE layer here, one JSON object a line "
                        "(also the result's 'decisions' field)")
    sim_args(r)
    r.add_argument("--quiet", action="store_true")
    model_args(r)
    r.set_defaults(fn=cmd_run)

    b = sub.add_parser("bench", help="prefill/decode tokens/s per batch size against the bandwidth roofline")
    b.add_argument("--batch", default="1,8,32")
    b.add_argument("--prompt-len", type=int, default=128)
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3)
    sim_args(b)
    model_args(b)
    b.set_defaults(fn=cmd_bench)

    c = sub.add_parser("compare-hf", help="this engine vs transformers and llama.cpp on the same checkpoint")
    c.add_argument("--model", default="builtin:qwen3_moe-medium")
    c.add_argument("--batch", default="1,32")
    c.add_argument("--prompt-len", type=int, default=128)
    c.add_argument("--new-tokens", type=int, default=64)
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--rounds", type=int, default=2, help="repeat the whole comparison, systems interleaved")
    c.add_argument("--threads", type=int, default=0, help="threads for every system (0 = PyTorch's default)")
    c.add_argument("--systems", default="default",
                   help="comma-separated subset of transformers, engine, engine_torch, engine_checkpoint, "
                        "engine_int8, engine_int8_a32, engine_int8_a16, engine_int8_a8, engine_q8, engine_int4, "
                        "llama_bf16, llama_q8_0, llama_q4_0 "
                        "(llama_* need llama-cpp-python); default: all but engine_checkpoint")
    c.add_argument("--staggered", type=int, default=32, help="requests in the staggered-arrivals comparison (0=skip)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=cmd_compare_hf)

    gg = sub.add_parser("gguf", help="write GGUF files of a qwen3_moe checkpoint for llama.cpp (needs gguf)")
    gg.add_argument("--model", default="builtin:qwen3_moe-medium")
    gg.add_argument("--kinds", default="bf16,q8_0,q4_0")
    gg.add_argument("--out", help="directory (default: the cache directory, where compare-hf looks)")
    gg.add_argument("--json", action="store_true")
    gg.set_defaults(fn=cmd_gguf)

    q = sub.add_parser("eval", help="quality of a config against the model's full-precision reference")
    q.add_argument("--prompts", help="a workload (path or builtin:<name>) whose prompts to score")
    q.add_argument("--max-prompts", type=int, default=8)
    q.add_argument("--text", help="a text file for perplexity (needs the model's tokenizer.json)")
    q.add_argument("--llama", metavar="KIND",
                   help="score llama.cpp on a GGUF of this kind (bf16, q8_0, q4_0) instead of the engine's config, on the same "
                        "prompts and reference (qwen3_moe checkpoints; needs the llama extra)")
    model_args(q)
    q.set_defaults(fn=cmd_eval)

    w = sub.add_parser("sweep", help="each hybrid knob alone: speed, memory, tier traffic, quality")
    w.add_argument("--knobs", help="comma-separated subset of the swept knobs")
    w.add_argument("--batch", type=int, default=8)
    w.add_argument("--prompt-len", type=int, default=64)
    w.add_argument("--new-tokens", type=int, default=16)
    w.add_argument("--repeats", type=int, default=3)
    w.add_argument("--quality-prompts", type=int, default=4)
    model_args(w)
    w.set_defaults(fn=cmd_sweep)

    from engine.serve.config import add_serve_args

    v = sub.add_parser("serve", help="the OpenAI API (completions, chat, models, metrics) for a model and config")
    v.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health "
                   "(default: $MOETUNE_API_KEY; none: no key)")
    model_args(v)
    add_serve_args(v)
    v.set_defaults(fn=cmd_serve)

    bs = sub.add_parser("bench-serve", help="HTTP overhead: `workloads replay` against `engine serve` vs "
                        "`engine run` in process, same workload and config")
    bs.add_argument("--workload", default=DEFAULT_WORKLOAD, help="workload path or builtin:<name>")
    bs.add_argument("--mode", choices=["realtime", "offline"], default="realtime")
    bs.add_argument("--rate-scale", type=float, default=1.0, help="divide arrival times by this")
    bs.add_argument("--max-requests", type=int, default=20, help="replay the first N requests (0 = all)")
    bs.add_argument("--repeats", type=int, default=3, help="interleaved rounds of (served, in process)")
    bs.add_argument("--warmup-rounds", type=int, default=1,
                    help="whole rounds of each run first and not counted (a fresh process is slower at first)")
    bs.add_argument("--inprocess-thread", choices=["worker", "main"], default="worker",
                    help="run the in-process replay on a worker thread (as the server's engine loop) or the main "
                    "thread (as `engine run`)")
    bs.add_argument("--http-thread-nice", type=int, help="the server's serve.http_thread_nice (default: its own)")
    bs.add_argument("--client-nice", type=int, default=10,
                    help="niceness of the replay client's thread (a remote client would take none of this CPU)")
    model_args(bs)
    bs.set_defaults(fn=cmd_bench_serve)

    cal = sub.add_parser("calibrate", help="measure this machine into a simulator profile (a few minutes)")
    cal.add_argument("--out", required=True, help="the profile JSON to write")
    cal.add_argument("--model", default="builtin:qwen3_moe-small",
                     help="the model whose live runs fit the engine's fixed costs")
    cal.add_argument("--name", help="the profile's name (default: calibrated-<hardware fingerprint>)")
    cal.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    cal.set_defaults(fn=cmd_calibrate)

    vs = sub.add_parser("validate-sim", help="run N configs from the tuner's space live and simulated: error per "
                        "metric and rank correlation")
    vs.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory or builtin:<arch>-<preset>")
    vs.add_argument("--workload", default=DEFAULT_WORKLOAD, help="workload path or builtin:<name>")
    vs.add_argument("--profile", required=True, help="profile file (`engine calibrate`) or builtin:<name>")
    vs.add_argument("--configs", type=int, default=8, help="configs to draw from the tuner's search space")
    vs.add_argument("--seed", type=int, default=0, help="seed of the random draws")
    vs.add_argument("--grid", choices=["random", "hybrid"], default="random",
                    help="random: configs drawn from the tuner's space; hybrid: the hybrid knobs one at a time "
                         "(budget 25/50/100 %% x host/fetch/auto, int8/int4, replicas, SM share; --configs caps it)")
    vs.add_argument("--mode", choices=["realtime", "offline"], default="offline")
    vs.add_argument("--max-requests", type=int, default=24, help="replay the first N requests (0 = all)")
    vs.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    vs.set_defaults(fn=cmd_validate_sim)

    pl = sub.add_parser("plan", help="price the hybrid knobs of a model on machines that are not here (simulated)")
    pl.add_argument("--profile", action="append", required=True,
                    help="a profile (repeat): a file from `engine calibrate` or builtin:<name>")
    pl.add_argument("--workload", default=DEFAULT_WORKLOAD, help="workload path or builtin:<name>")
    pl.add_argument("--max-requests", type=int, default=0, help="replay the first N requests (0 = all)")
    pl.add_argument("--slo", action="append", metavar="NAME=VALUE|FILE",
                    help="the capacity column's SLO bound (repeat), as `tuner run --slo` (default: the tuner's "
                         "latency bounds)")
    pl.add_argument("--quiet", action="store_true")
    pl.add_argument("--db", help="store the plan in this results database, for the dashboard's Plans page "
                                 "(default $MOETUNE_DB, else sqlite:///moetune.db)")
    pl.add_argument("--no-db", action="store_true", help="store nothing (print only)")
    model_args(pl)
    pl.set_defaults(fn=cmd_plan)

    k = sub.add_parser("knobs", help="every knob: default, range, search range, meaning")
    k.add_argument("--json", action="store_true")
    k.set_defaults(fn=cmd_knobs)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from engine.parallel import EPError
    from workloads.schema import WorkloadError

    try:
        return args.fn(args)
    except (ConfigError, CheckpointError, WorkloadError, EPError, ValueError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"engine: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("engine: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
