"""Attach a recorded router trace to a workload.

The recording itself is the engine's (``engine.runner.record_router_trace``: a live run that keeps
the routes of every processed token); this module only trims the workload and files the trace and
its provenance, so the dependency runs one way: the engine reads workloads, workloads never import
the engine (``workloads record`` passes the engine's recorder in).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from workloads.errors import WorkloadError
from workloads.router import RouterTrace
from workloads.schema import Workload

log = logging.getLogger(__name__)

Recorder = Callable[[Workload], RouterTrace]
"""Runs a workload on a model and returns the router trace of every token it processed."""


def record_workload(model: str, workload: Workload, recorder: Recorder, *,
                    max_requests: int | None = None) -> Workload:
    """``workload`` (its first ``max_requests`` requests) with the router trace ``recorder`` records
    on ``model`` attached, and the recording noted in its metadata."""
    if max_requests is not None:
        if max_requests < 1:
            raise WorkloadError(f"max-requests: {max_requests} is less than 1")
        workload = workload.with_requests(workload.requests[:max_requests])
    log.info("recording the router trace of %d requests with %s", len(workload), model)
    trace = recorder(workload)
    metadata = dict(workload.metadata)
    metadata["router_trace"] = {"model": model, "model_identity": trace.model_identity,
                                "n_requests": len(trace), "n_tokens": trace.n_tokens}
    return workload.with_router_trace(trace, metadata=metadata)
