"""Replay a workload through the engine and measure every request, step and expert.

Real-time mode releases each request at its arrival time (divided by ``rate_scale``) on the wall
clock, so queueing shows up in TTFT; offline mode releases them all at time zero (throughput).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from engine.config import inert_knobs
from engine.hwinfo import hardware, software
from engine.results import ExpertStat, RequestResult, RunResult, StepRecord
from engine.runtime import Engine
from engine.telemetry import TelemetrySampler

if TYPE_CHECKING:
    from workloads.router import RouterTrace
    from workloads.schema import Workload

log = logging.getLogger(__name__)

Mode = Literal["realtime", "offline"]


def run_workload(engine: Engine, workload: Workload, mode: Mode = "realtime", rate_scale: float = 1.0,
                 max_requests: int | None = None, record_routes: bool = False,
                 on_step: Callable[[int, int], Any] | None = None) -> RunResult:
    """Replay ``workload`` on ``engine``; returns per-request, per-step, per-expert results and telemetry.

    ``on_step(done, total)`` is called after every step (progress bars, pruning callbacks); when it
    returns True the run stops there and returns what it measured so far (the engine keeps the
    unfinished sequences: reconfigure it before the next run).
    With ``record_routes`` the result's ``meta["routes"]`` holds, per request key, the expert ids and gate
    weights of every token the model processed for it: arrays [tokens, moe layers, k].
    """
    if rate_scale <= 0:
        raise ValueError(f"rate_scale={rate_scale}: must be > 0")
    if workload.router_trace is not None:
        # A trace recorded with another model would mislead every placement decision built on it.
        workload.router_trace.check_model(engine.spec.identity(engine.fingerprint), f"workload {workload.name}")
        if engine.config.experts.residency in ("static", "dynamic"):
            engine.set_hotness(workload.router_trace.hotness())
    if engine.hotness is None:
        engine.warm_up_hotness()  # no-op unless static or dynamic residency needs a profile
    requests = list(workload.requests)[: max_requests or None]
    seed = engine.config.runtime.seed
    prompts = {r.request_id: r.prompt_token_ids(engine.spec.vocab_size, seed) for r in requests}
    arrivals = {r.request_id: (0.0 if mode == "offline" else r.arrival_s / rate_scale) for r in requests}
    results = {r.request_id: RequestResult(r.request_id, arrivals[r.request_id], len(prompts[r.request_id]), 0,
                                           None, None, [], "", r.tag) for r in requests}
    last_token_s: dict[str, float] = {}
    steps: list[StepRecord] = []
    routes: dict[str, list[np.ndarray]] = {}
    engine.model.stats.reset()
    engine.model.record_routes = record_routes
    pending = sorted(requests, key=lambda r: arrivals[r.request_id])
    next_req = 0
    n_done = 0
    sampler = TelemetrySampler()
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    t0 = time.perf_counter()
    sampler.start(t0)
    try:
        while next_req < len(pending) or engine.has_work:
            now = time.perf_counter() - t0
            while next_req < len(pending) and arrivals[pending[next_req].request_id] <= now:
                r = pending[next_req]
                seq = engine.add(r.request_id, prompts[r.request_id], r.max_new_tokens)
                if seq.finish_reason == "rejected":
                    results[r.request_id].finish_reason = "rejected"
                    n_done += 1
                next_req += 1
            if not engine.has_work:
                # Nothing to run until the next request arrives: wait for it on the wall clock.
                time.sleep(max(0.0, arrivals[pending[next_req].request_id] - (time.perf_counter() - t0)))
                continue
            start_s = time.perf_counter() - t0
            out = engine.step()
            end_s = time.perf_counter() - t0
            steps.append(StepRecord(len(steps), start_s, out.duration_s * 1e3, out.batch_seqs, out.prefill_tokens,
                                    out.decode_tokens))
            if record_routes:
                _collect_routes(engine, routes)
            for key, tok in out.tokens:
                res = results[key]
                if res.first_token_s is None:
                    res.first_token_s = end_s
                else:
                    res.itl_ms.append((end_s - last_token_s[key]) * 1e3)
                last_token_s[key] = end_s
                res.output_tokens += 1
                res.output_ids.append(tok)
            for seq in out.finished:
                results[seq.key].finish_s = end_s
                results[seq.key].finish_reason = seq.finish_reason or "length"
                n_done += 1
            if on_step is not None and on_step(n_done, len(requests)) is True:
                break  # the caller has its verdict; unfinished requests stay unfinished (finish_reason "")
    finally:
        engine.model.record_routes = False
        telemetry = sampler.stop()
        if engine.model.hybrid is not None:
            engine.model.hybrid.drain()
    duration_s = time.perf_counter() - t0
    peak_dev = int(torch.cuda.max_memory_allocated(engine.device)) if engine.device.type == "cuda" else None
    meta = run_meta(engine, workload, mode, rate_scale)
    if record_routes:
        meta["routes"] = {k: _stack_routes(v) for k, v in routes.items()}
    return RunResult(meta=meta, requests=[results[r.request_id] for r in requests], steps=steps,
                     telemetry=telemetry, expert_stats=expert_stats(engine), duration_s=duration_s,
                     peak_rss_bytes=sampler.peak_rss_bytes(), peak_device_mem_bytes=peak_dev)


def _collect_routes(engine: Engine, routes: dict[str, list[np.ndarray]]) -> None:
    """Split the last step's per-layer expert choices by request."""
    recs = engine.model.routes
    if not recs:
        return
    ids = torch.stack([r.expert_ids for r in recs], dim=1).cpu().numpy().astype(np.int16)  # [T, L, K]
    ws = torch.stack([r.gate_weights for r in recs], dim=1).float().cpu().numpy().astype(np.float16)
    for key, start, n in engine.last_token_owners:
        routes.setdefault(key, []).append(np.stack([ids[start: start + n], ws[start: start + n]]))


def _stack_routes(chunks: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    arr = np.concatenate(chunks, axis=1)  # [2, tokens, L, K]
    return arr[0].astype(np.int16), arr[1].astype(np.float16)


def expert_stats(engine: Engine) -> list[ExpertStat]:
    """Tokens routed to each expert, and where it lived and in which precision at the end of the run."""
    precision = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[str(engine.dtype).replace("torch.", "")]
    table = engine.model.hybrid.expert_table() if engine.model.hybrid is not None else {}
    out = []
    for layer, counts in sorted(engine.model.stats.counts.items()):
        for e, n in enumerate(counts.tolist()):
            resident, prec, replicas = table.get((layer, e), (True, precision, 0))
            out.append(ExpertStat(layer, e, int(n), resident=resident, precision=prec, replicas=replicas))
    return out


def popularity(result: RunResult) -> list[dict[str, Any]]:
    """Per MoE layer: tokens routed, the share the hottest 10 % of experts got, normalised entropy, and
    the hottest experts (the same skew measures ``workloads show`` reports for router traces)."""
    from workloads.router import normalized_entropy, top_share

    by_layer: dict[int, list[int]] = {}
    for s in result.expert_stats:
        by_layer.setdefault(s.layer, []).append(s.tokens)
    rows = []
    for layer, counts in sorted(by_layer.items()):
        c = np.array(counts, dtype=np.float64)
        if c.sum() == 0:
            continue
        p = c / c.sum()
        rows.append({"layer": layer, "tokens": int(c.sum()), "top10pct_share": float(top_share(p, 0.1)),
                     "entropy_norm": float(normalized_entropy(p)),
                     "hottest": [int(i) for i in np.argsort(-c, kind="stable")[:5]]})
    return rows


def run_meta(engine: Engine, workload: Workload, mode: str, rate_scale: float) -> dict[str, Any]:
    return {
        "model": {**engine.ckpt.describe(), "fingerprint": engine.fingerprint,
                  "identity": engine.spec.identity(engine.fingerprint)},
        "workload": {"name": workload.name, "requests": len(workload.requests)},
        "mode": mode,
        "rate_scale": rate_scale,
        "config": engine.config.to_dict(),
        "config_hash": engine.config.config_hash(),
        "device": str(engine.device),
        "compute_dtype": str(engine.dtype).replace("torch.", ""),
        "weight_dtype": str(engine.weight_dtype).replace("torch.", ""),
        "cpu_kernels": engine.kernels_label,
        # Tiers are distinct only with an accelerator; elsewhere the hybrid code runs on host memory alone.
        "hybrid": engine.device.type == "cuda" and engine.model.hybrid is not None,
        "inert_knobs": {**inert_knobs(engine.device.type == "cuda"),
                        **(engine.model.hybrid.inert if engine.model.hybrid is not None else {})},
        "tiers": engine.model.hybrid.stats.as_dict() if engine.model.hybrid is not None else None,
        "fast_tier_expert_bytes": engine.model.hybrid.fast_bytes() if engine.model.hybrid is not None else None,
        "hardware": hardware(),
        "software": software(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def record_router_trace(model: str, workload: Workload, config=None, max_requests: int | None = None
                        ) -> RouterTrace:
    """Run ``workload`` offline on ``model`` and return the router trace of every processed token."""
    from workloads.router import RouterTrace

    engine = Engine(model, config)
    result = run_workload(engine, workload, mode="offline", max_requests=max_requests, record_routes=True)
    routes = result.meta["routes"]
    keys = [r.request_id for r in workload.requests[: max_requests or None] if r.request_id in routes]
    return RouterTrace.from_arrays(
        request_ids=keys,
        expert_ids=[routes[k][0] for k in keys],
        gate_weights=[routes[k][1] for k in keys],
        model_identity=engine.spec.identity(engine.fingerprint),
    )
