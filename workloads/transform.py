"""Transformations of a workload: rate scaling, time windows, sampling, length clipping, cycling.

Each returns a new :class:`Workload`, records itself in ``metadata["transforms"]``, and keeps the
router trace consistent: it keeps the trace entries of the requests that remain, drops the entry
of a request whose prompt was clipped (its routing after the cut would differ) and cuts the entry
of a request whose output was clipped to the tokens that are still processed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np

from workloads.errors import WorkloadError
from workloads.schema import Request, Workload, n_blocks

log = logging.getLogger(__name__)

#: What :func:`cycle` appends to a copy's request id (``<id>~cycle<k>``).
COPY_MARK = "~cycle"


def is_copy(request_id: str) -> bool:
    """Whether ``request_id`` names a copy :func:`cycle` made (not one of the workload's own requests)."""
    return COPY_MARK in request_id


def _noted(workload: Workload, step: dict[str, Any]) -> dict[str, Any]:
    metadata = dict(workload.metadata)
    metadata["transforms"] = [*metadata.get("transforms", []), step]
    return metadata


def rate_scale(workload: Workload, factor: float) -> Workload:
    """Arrivals divided by ``factor``: 2 doubles the request rate, 0.5 halves it."""
    if not (math.isfinite(factor) and factor > 0):
        raise WorkloadError(f"rate-scale: {factor} is not a finite number > 0")
    requests = [dataclasses.replace(r, arrival_s=round(r.arrival_s / factor, 6)) for r in workload.requests]
    return workload.with_requests(requests, metadata=_noted(workload, {"rate_scale": factor}))


def cycle(workload: Workload, n_requests: int) -> Workload:
    """The workload's requests replayed again until there are ``n_requests`` (MLPerf's loadgen repeats its
    sample set the same way to reach a minimum duration).

    Copy ``k`` (1, 2, ...) of request ``id`` is ``id~cyclek``, arriving ``k`` periods later; a period is the
    arrival span plus one mean gap, so the copies keep the workload's rate and burstiness. A copy keeps
    the prompt (its ids, or its length and synthetic tokens), output length and router-trace entry of
    its original; its prefix blocks are renamed, so that it shares no cached prefix with the original.
    """
    requests = list(workload.requests)
    if n_requests < 1:
        raise WorkloadError(f"cycle: {n_requests} is less than 1")
    if not requests:
        raise WorkloadError(f"cycle: workload {workload.name!r} has no requests")
    if n_requests <= len(requests):
        return workload.with_requests(requests[:n_requests])
    n = len(requests)
    first, last = min(r.arrival_s for r in requests), max(r.arrival_s for r in requests)
    period_s = (last - first) * n / (n - 1) if n > 1 else 0.0
    hash_span = 1 + max((max(r.hash_ids) for r in requests if r.hash_ids), default=-1)
    out = list(requests)
    for i in range(n, n_requests):
        k, r = divmod(i, n)
        orig = requests[r]
        out.append(dataclasses.replace(
            orig, request_id=f"{orig.request_id}{COPY_MARK}{k}", arrival_s=round(orig.arrival_s + k * period_s, 6),
            hash_ids=tuple(h + k * hash_span for h in orig.hash_ids) if orig.hash_ids else orig.hash_ids))
    trace = workload.router_trace
    if trace is not None:
        kept = [(requests[i % n].request_id, r.request_id) for i, r in enumerate(out)
                if requests[i % n].request_id in trace]
        trace = trace.subset([a for a, _ in kept], as_ids=[b for _, b in kept])
    step = {"cycle": n_requests}
    return Workload(workload.name, out, _noted(workload, step), trace)


def parse_window(text: str) -> tuple[float, float]:
    """``"A:B"`` (seconds, either side may be empty) to ``(start_s, end_s)``."""
    start, sep, end = text.partition(":")
    try:
        start_s = float(start) if start else 0.0
        end_s = float(end) if end else math.inf
    except ValueError:
        raise WorkloadError(f"window: {text!r} is not A:B in seconds") from None
    if not sep or start_s < 0 or end_s <= start_s:
        raise WorkloadError(f"window: {text!r} is not A:B in seconds with 0 <= A < B")
    return start_s, end_s


def window(workload: Workload, start_s: float, end_s: float) -> Workload:
    """The requests arriving in ``[start_s, end_s)``, with ``start_s`` moved to time 0."""
    requests = [dataclasses.replace(r, arrival_s=round(r.arrival_s - start_s, 6))
                for r in workload.requests if start_s <= r.arrival_s < end_s]
    if not requests:
        raise WorkloadError(f"window: no request arrives in [{start_s}, {end_s}) s "
                            f"(the workload spans {workload.duration_s:.3f} s)")
    step = {"window_s": [start_s, end_s if math.isfinite(end_s) else None]}
    return workload.with_requests(requests, metadata=_noted(workload, step))


def sample(workload: Workload, n_requests: int, seed: int = 0) -> Workload:
    """A seeded random subset of ``n_requests`` requests, arrival times unchanged (a thinned process)."""
    if n_requests < 1:
        raise WorkloadError(f"sample: {n_requests} is less than 1")
    if n_requests >= len(workload):
        log.info("sample: keeping all %d requests", len(workload))
        n_requests = len(workload)
    keep = np.sort(np.random.default_rng(seed).choice(len(workload), n_requests, replace=False))
    requests = [workload.requests[i] for i in keep]
    return workload.with_requests(requests, metadata=_noted(workload, {"sample": n_requests, "seed": seed}))


def clip_lengths(workload: Workload, max_prompt_len: int | None = None,
                 max_output_len: int | None = None) -> Workload:
    """Clip prompts to ``max_prompt_len`` tokens (keeping the head) and outputs to ``max_output_len``."""
    for key, value in (("max-prompt-len", max_prompt_len), ("max-output-len", max_output_len)):
        if value is not None and value < 1:
            raise WorkloadError(f"{key}: {value} is less than 1")
    trace = workload.router_trace
    requests: list[Request] = []
    drop_from_trace: set[str] = set()
    cut_trace: dict[str, int] = {}
    n_prompt = n_output = 0
    for r in workload.requests:
        changes: dict[str, Any] = {}
        if max_prompt_len is not None and r.prompt_len > max_prompt_len:
            n_prompt += 1
            changes["prompt_len"] = max_prompt_len
            if r.prompt_ids is not None:
                changes["prompt_ids"] = r.prompt_ids[:max_prompt_len]
            if r.hash_ids is not None:
                changes["hash_ids"] = r.hash_ids[:n_blocks(max_prompt_len)]
            drop_from_trace.add(r.request_id)
        if max_output_len is not None and r.max_new_tokens > max_output_len:
            n_output += 1
            changes["max_new_tokens"] = max_output_len
            cut_trace[r.request_id] = r.prompt_len + max_output_len - 1
        requests.append(dataclasses.replace(r, **changes) if changes else r)
    if trace is not None:
        if drop_from_trace & set(trace.request_ids):
            log.warning("clip: dropped the router trace of %d requests whose prompts were clipped",
                        len(drop_from_trace & set(trace.request_ids)))
        kept = [rid for rid in trace.request_ids if rid not in drop_from_trace]
        trace = trace.subset(kept, {rid: n for rid, n in cut_trace.items() if rid in trace})
    step = {"max_prompt_len": max_prompt_len, "max_output_len": max_output_len,
            "clipped_prompts": n_prompt, "clipped_outputs": n_output}
    return Workload(workload.name, requests, _noted(workload, step), trace)


def apply_transforms(workload: Workload, *, window_s: tuple[float, float] | None = None,
                     sample_n: int | None = None, seed: int = 0, rate_scale_factor: float | None = None,
                     max_prompt_len: int | None = None, max_output_len: int | None = None) -> Workload:
    """Apply, in this order: window (in the original seconds), sample, rate scale, length clipping."""
    if window_s is not None:
        workload = window(workload, *window_s)
    if sample_n is not None:
        workload = sample(workload, sample_n, seed)
    if rate_scale_factor is not None:
        workload = rate_scale(workload, rate_scale_factor)
    if max_prompt_len is not None or max_output_len is not None:
        workload = clip_lengths(workload, max_prompt_len, max_output_len)
    return workload
