"""The server's Prometheus metrics (``GET /metrics``), in their own registry.

Latencies are the per-request definitions of ``engine.results.RequestResult`` (TTFT from the
request's arrival at the server to its first token, TPOT over the tokens after the first, E2E),
in seconds as Prometheus names them. Names follow vLLM's where one exists, under ``moetune:``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.results import RequestResult

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS_S = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0)
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
#: Where an expert call ran (``engine.moe.experts.TierStats``), as the ``tier`` label.
TIERS = ("fast_hi", "fast_lo", "host", "fetched", "replica")


class ServeMetrics:
    """Every metric of one server."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, {"model_name": model_name}
        self.ttft = Histogram("moetune:time_to_first_token_seconds", "Time from a request's arrival to its first "
                              "token.", ["model_name"], buckets=TTFT_BUCKETS_S, registry=r).labels(**labels)
        self.tpot = Histogram("moetune:time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request.", ["model_name"], buckets=TPOT_BUCKETS_S,
                              registry=r).labels(**labels)
        self.e2e = Histogram("moetune:e2e_request_latency_seconds", "Time from a request's arrival to its last "
                             "token.", ["model_name"], buckets=E2E_BUCKETS_S, registry=r).labels(**labels)
        self.step = Histogram("moetune:step_duration_seconds", "Duration of one engine step (one forward pass).",
                              ["model_name"], buckets=STEP_BUCKETS_S, registry=r).labels(**labels)
        self.running = Gauge("moetune:num_requests_running", "Requests holding a sequence slot.", ["model_name"],
                             registry=r).labels(**labels)
        self.waiting = Gauge("moetune:num_requests_waiting", "Requests waiting for a sequence slot.",
                             ["model_name"], registry=r).labels(**labels)
        self.prompt_tokens = Counter("moetune:prompt_tokens", "Prompt tokens of admitted requests.",
                                     ["model_name"], registry=r).labels(**labels)
        self.generation_tokens = Counter("moetune:generation_tokens", "Tokens generated.", ["model_name"],
                                         registry=r).labels(**labels)
        self._finished = Counter("moetune:request_success", "Finished requests by finish reason.",
                                 ["model_name", "finished_reason"], registry=r)
        self.rejected = Counter("moetune:requests_rejected", "Requests refused with 429 (queue full).",
                                ["model_name"], registry=r).labels(**labels)
        self._expert_calls = Counter("moetune:expert_calls", "Expert calls by the tier they ran on.",
                                     ["model_name", "tier"], registry=r)
        self.fetched_bytes = Counter("moetune:fetched_bytes", "Expert weight bytes copied to the fast tier.",
                                     ["model_name"], registry=r).labels(**labels)
        self.steps = Counter("moetune:engine_steps", "Engine steps run.", ["model_name"], registry=r).labels(**labels)
        self.step_errors = Counter("moetune:engine_step_errors", "Engine steps that raised (their requests fail; "
                                   "the loop goes on).", ["model_name"], registry=r).labels(**labels)
        self._model = model_name
        for tier in TIERS:
            self._expert_calls.labels(model_name, tier)  # present at 0 from the start

    def finished(self, result: RequestResult, reason: str) -> None:
        """A request ended: its latencies by the shared definitions, counted by finish reason."""
        self._finished.labels(self._model, reason).inc()
        if result.ttft_ms is not None:
            self.ttft.observe(result.ttft_ms / 1e3)
        if result.tpot_ms is not None:
            self.tpot.observe(result.tpot_ms / 1e3)
        if result.e2e_ms is not None and result.output_tokens:
            self.e2e.observe(result.e2e_ms / 1e3)

    def expert_calls(self, tier: str, n: int) -> None:
        if n > 0:
            self._expert_calls.labels(self._model, tier).inc(n)
