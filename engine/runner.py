"""Replay a workload through a backend and measure every request, step and expert.

Real-time mode releases each request at its arrival time (divided by ``rate_scale``) on the
backend's clock, so queueing shows up in TTFT; offline mode releases them all at time zero
(throughput). The runner knows only the step interface of :mod:`engine.backend`: the live engine
runs on the wall clock, a backend without tensors on a virtual clock that jumps to the next arrival.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from engine.backend import Backend, Clock, RunStart, as_backend, make_backend
from engine.hwinfo import hardware, software
from engine.results import RequestResult, RunResult, StepRecord
from engine.telemetry import TelemetrySampler

if TYPE_CHECKING:
    from workloads.router import RouterTrace
    from workloads.schema import Workload

log = logging.getLogger(__name__)

Mode = Literal["realtime", "offline"]


@dataclass(frozen=True)
class RunProgress:
    """What a run has done so far, handed to ``on_progress`` after every step: the clock's time,
    requests finished (or rejected) of the total, and each request's timeline so far (times in
    seconds of the run's clock; read-only)."""

    now_s: float
    done: int
    total: int
    requests: Mapping[str, RequestResult]


def run_workload(backend: Backend | Any, workload: Workload, mode: Mode = "realtime", rate_scale: float = 1.0,
                 max_requests: int | None = None, record_routes: bool = False,
                 on_step: Callable[[int, int], Any] | None = None, *, clock: Clock | None = None,
                 decisions: bool = False, on_progress: Callable[[RunProgress], Any] | None = None) -> RunResult:
    """Replay ``workload`` on ``backend``; returns per-request, per-step, per-expert results and telemetry.

    ``backend`` is any :class:`~engine.backend.Backend` (an :class:`~engine.runtime.Engine` is wrapped
    as the live one). ``clock`` defaults to the backend's own. ``on_step(done, total)`` is called after
    every step (progress bars) and ``on_progress`` with a :class:`RunProgress` (SLO watches): when it
    returns True the run stops there and returns what it measured so far, its unfinished requests
    aborted on the backend (finish_reason ""); an exception it raises ends the run. With ``record_routes`` the result's ``meta["routes"]`` holds,
    per request key, the expert ids and gate weights of every token the model processed for it:
    arrays [tokens, moe layers, k]. With ``decisions`` the result's ``decisions`` holds the plan of
    every step and MoE layer (see :class:`~engine.moe.policy.plan.DecisionLog`).
    """
    if rate_scale <= 0:
        raise ValueError(f"rate_scale={rate_scale}: must be > 0")
    backend = as_backend(backend)
    backend.start(RunStart(f"workload {workload.name}", workload.router_trace, record_routes, decisions))
    requests = list(workload.requests)[: max_requests or None]
    seed = backend.config.runtime.seed
    vocab = backend.spec.vocab_size
    prompts = {r.request_id: r.prompt_token_ids(vocab, seed) for r in requests}
    arrivals = {r.request_id: (0.0 if mode == "offline" else r.arrival_s / rate_scale) for r in requests}
    results = {r.request_id: RequestResult(r.request_id, arrivals[r.request_id], len(prompts[r.request_id]), 0,
                                           None, None, [], "", r.tag) for r in requests}
    last_token_s: dict[str, float] = {}
    steps: list[StepRecord] = []
    pending = sorted(requests, key=lambda r: arrivals[r.request_id])
    next_req = 0
    n_done = 0
    clock = clock or backend.clock()
    sampler = TelemetrySampler() if clock.real else None
    t0 = time.perf_counter()
    clock.start()
    if sampler is not None:
        sampler.start(t0)
    tail = None
    try:
        while next_req < len(pending) or backend.has_work:
            now = clock.now()
            while next_req < len(pending) and arrivals[pending[next_req].request_id] <= now:
                r = pending[next_req]
                seq = backend.add(r.request_id, prompts[r.request_id], r.max_new_tokens)
                if seq.finish_reason == "rejected":
                    results[r.request_id].finish_reason = "rejected"
                    n_done += 1
                next_req += 1
            if not backend.has_work:
                # Nothing to run until the next request arrives: wait for it on the clock.
                clock.wait_until(arrivals[pending[next_req].request_id])
                continue
            start_s = clock.now()
            out = backend.step()
            clock.advance(out.duration_s)
            end_s = clock.now()
            ep = out.ep or {}
            steps.append(StepRecord(len(steps), start_s, out.duration_s * 1e3, out.batch_seqs, out.prefill_tokens,
                                    out.decode_tokens, ep.get("bytes_dispatched"), ep.get("bytes_combined"),
                                    ep.get("imbalance")))
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
            if on_step is not None:
                on_step(n_done, len(requests))
            if on_progress is not None and on_progress(RunProgress(end_s, n_done, len(requests), results)) is True:
                # The caller has its verdict: the rest is dropped, so the backend is idle for the next run.
                for r in requests:
                    if not results[r.request_id].finish_reason:
                        backend.abort(r.request_id)
                break
    finally:
        telemetry = sampler.stop() if sampler is not None else []
        tail = backend.finish()
    duration_s = clock.now()
    described = backend.describe()
    meta = {**described, **run_meta(backend, workload, mode, rate_scale, described)}
    meta.update(tiers=tail.tiers.as_dict() if tail.tiers is not None else None,
                fast_tier_expert_bytes=tail.fast_tier_expert_bytes, **tail.extra_meta)
    if record_routes:
        meta["routes"] = tail.routes or {}
    return RunResult(meta=meta, requests=[results[r.request_id] for r in requests], steps=steps,
                     telemetry=telemetry, expert_stats=tail.expert_stats, duration_s=duration_s,
                     peak_rss_bytes=sampler.peak_rss_bytes() if sampler is not None else 0,
                     peak_device_mem_bytes=tail.peak_device_mem_bytes, decisions=tail.decisions)


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


def run_meta(backend: Backend, workload: Workload, mode: str, rate_scale: float,
             described: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What a run ran besides the backend's own description: workload, mode, config, machine, time.
    A backend that describes the machine and software itself (the simulator: its profile's machine)
    gives them in ``described``."""
    described = described or {}
    return {
        "workload": {"name": workload.name, "requests": len(workload.requests)},
        "mode": mode,
        "rate_scale": rate_scale,
        "config": backend.config.to_dict(),
        "config_hash": backend.config.config_hash(),
        "hardware": described.get("hardware") or hardware(),
        "software": described.get("software") or software(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def record_router_trace(model: str, workload: Workload, config=None, max_requests: int | None = None
                        ) -> RouterTrace:
    """Run ``workload`` offline on ``model`` (the live backend) and return the router trace of every
    processed token: the model's own top-k choices, before any routing knob prunes them."""
    from workloads.router import RouterTrace

    backend = make_backend(model, config)
    result = run_workload(backend, workload, mode="offline", max_requests=max_requests, record_routes=True)
    routes = result.meta["routes"]
    keys = [r.request_id for r in workload.requests[: max_requests or None] if r.request_id in routes]
    return RouterTrace.from_arrays(
        request_ids=keys,
        expert_ids=[routes[k][0] for k in keys],
        gate_weights=[routes[k][1] for k in keys],
        model_identity=backend.model_identity(),
    )
