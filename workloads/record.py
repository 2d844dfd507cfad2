"""Record a real router trace by running the engine over a workload."""

from __future__ import annotations

import logging
from typing import Any

from workloads.errors import WorkloadError
from workloads.schema import Workload

log = logging.getLogger(__name__)


def record_workload(model: str, workload: Workload, *, max_requests: int | None = None,
                    config: Any = None) -> Workload:
    """Run ``model`` over (the first ``max_requests`` requests of) ``workload``; return it with the
    recorded router trace attached.

    The engine does the work (``engine.runner.record_router_trace``); it is imported here so that
    the workloads package loads without the engine.
    """
    if max_requests is not None:
        if max_requests < 1:
            raise WorkloadError(f"max-requests: {max_requests} is less than 1")
        workload = workload.with_requests(workload.requests[:max_requests])
    try:
        from engine.runner import record_router_trace
    except ImportError as e:
        raise WorkloadError(f"recording needs engine.runner.record_router_trace, which is not available ({e})") from None
    log.info("recording the router trace of %d requests with %s", len(workload), model)
    trace = record_router_trace(model, workload, config)
    metadata = dict(workload.metadata)
    metadata["router_trace"] = {"model": model, "model_identity": trace.model_identity,
                                "n_requests": len(trace), "n_tokens": trace.n_tokens}
    return workload.with_router_trace(trace, metadata=metadata)
