"""The one place the server touches the engine: a scheduler thread that owns an ``Engine``.

Requests from every HTTP client join the engine's continuous batching through :meth:`EngineLoop.submit`;
the thread runs :meth:`Engine.step` while there is work and hands what each step produced for a
request (its token, and its end when it ended) to the request's ``sink`` in one call: a callable
that must not block. With a ``dispatch`` (the HTTP side sets one that wakes its event loop once per
step), the step's ``(sink, events)`` pairs go to it instead, and it calls the sinks where it likes. The HTTP side never calls the engine: it only queues (submit, abort) and streams.

A request that fails, a client that vanishes, a sink that raises, even an engine step that raises,
ends only the requests concerned: the loop logs it and goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.results import RequestResult
from engine.runtime import Engine, SamplingParams
from engine.serve.metrics import ServeMetrics

__all__ = ["EngineLoop", "Event", "ModelInfo", "QueueFull", "SamplingParams"]

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.25  # how long an idle loop sleeps on its inbox before looking at the stop flag


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP side needs to know about the model and config being served."""

    path: str
    arch: str
    vocab_size: int
    max_seq_len_tokens: int
    max_batch_seqs: int
    eos_token_ids: tuple[int, ...]
    identity: dict[str, Any]
    config: dict[str, Any]
    config_hash: str
    device: str
    compute_dtype: str
    cpu_kernels: str


@dataclass(frozen=True)
class Event:
    """What happened to one request: a ``token``, ``done`` (reason "length", "eos") or ``error``."""

    kind: str
    token: int = -1
    reason: str = ""
    t: float = 0.0  # time.perf_counter() when the step that produced it ended


class QueueFull(Exception):
    """Every sequence slot is taken and the waiting queue is full."""


Sink = Callable[[tuple[Event, ...]], None]
Dispatch = Callable[[list[tuple[Sink, tuple[Event, ...]]]], None]


@dataclass
class _Live:
    sink: Sink
    result: RequestResult
    prompt_tokens: int
    last_token_t: float | None = None
    itl_s: list[float] = field(default_factory=list)


class EngineLoop:
    """A scheduler thread driving one engine for many concurrent requests."""

    def __init__(self, engine: Engine, *, max_waiting: int, metrics: ServeMetrics | None = None,
                 dispatch: Dispatch | None = None):
        self.engine = engine
        self.metrics = metrics
        self.dispatch = dispatch
        self.capacity = engine.config.scheduler.max_batch_seqs + max_waiting
        spec = engine.spec
        self.info = ModelInfo(
            path=str(engine.model_path), arch=spec.arch, vocab_size=spec.vocab_size,
            max_seq_len_tokens=engine.config.scheduler.max_seq_len_tokens,
            max_batch_seqs=engine.config.scheduler.max_batch_seqs, eos_token_ids=tuple(spec.eos_token_ids),
            identity=spec.identity(engine.fingerprint), config=engine.config.to_dict(),
            config_hash=engine.config.config_hash(), device=str(engine.device),
            compute_dtype=str(engine.dtype).replace("torch.", ""), cpu_kernels=engine.kernels_label)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # loop thread only
        self._lock = threading.Lock()
        self._outstanding: set[str] = set()  # under _lock: submitted and not yet finished
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.perf_counter()
        self._tier_seen: dict[str, int] = {}
        self.steps = 0

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        if self.engine.hotness is None:
            self.engine.warm_up_hotness()  # static/dynamic residency need a hotness profile (else no-op)
        self._tier_seen = self._tier_counts()
        self._thread = threading.Thread(target=self._run, name="moetune-engine-loop", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.engine.model.hybrid is not None:
            self.engine.model.hybrid.drain()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, request_id: str, prompt: list[int], max_tokens: int, sampling: SamplingParams | None,
               sink: Sink, arrival: float) -> None:
        """Queue a request (already validated against :attr:`info`); raises :class:`QueueFull`.

        ``arrival`` is the ``time.perf_counter()`` at which the request reached the server.
        """
        with self._lock:
            if len(self._outstanding) >= self.capacity:
                if self.metrics is not None:
                    self.metrics.rejected.inc()
                raise QueueFull(f"{len(self._outstanding)} requests running or waiting (the most this server "
                                f"queues is {self.capacity})")
            if request_id in self._outstanding:
                raise ValueError(f"request id {request_id} is already in flight")
            self._outstanding.add(request_id)
        self._inbox.put(("submit", (request_id, list(prompt), max_tokens, sampling, sink, arrival)))

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request early (client gone, stop string found) and free its KV cache slot."""
        self._inbox.put(("abort", (request_id, reason)))

    def counts(self) -> tuple[int, int]:
        """(running, waiting) as last seen by the loop."""
        with self._lock:
            outstanding = len(self._outstanding)
        running = min(len(self.engine.running), outstanding)
        return running, outstanding - running

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain(block=not self.engine.has_work)
                if self.engine.has_work:
                    self._step()
                self._gauges()
            except Exception:  # never let one bad iteration end the server
                log.exception("engine loop: unexpected error; going on")

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "submit":
                self._add(*payload)
            elif kind == "abort":
                self._abort(*payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, request_id: str, prompt: list[int], max_tokens: int, sampling: SamplingParams | None,
             sink: Sink, arrival: float) -> None:
        result = RequestResult(request_id, arrival - self._t0, len(prompt), 0, None, None, [], "")
        live = _Live(sink, result, len(prompt))
        self._live[request_id] = live
        try:
            seq = self.engine.add(request_id, prompt, max_tokens, sampling)
        except ValueError as e:  # the HTTP side validates first; this is the engine's own check
            self._finish(request_id, "error", str(e))
            return
        if seq.finish_reason == "rejected":
            self._finish(request_id, "error", f"{len(prompt)} prompt + {max_tokens} new tokens exceed "
                         f"max_seq_len_tokens={self.info.max_seq_len_tokens}")
            return
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(prompt))

    def _abort(self, request_id: str, reason: str) -> None:
        if request_id not in self._live:
            return  # finished meanwhile
        self.engine.abort(request_id)
        self._finish(request_id, reason, notify=False)

    def _step(self) -> None:
        try:
            out = self.engine.step()
        except Exception as e:
            # The step's state is unknown: end every request in the engine, keep serving new ones.
            log.exception("engine step failed; ending the %d requests in flight", len(self._live))
            if self.metrics is not None:
                self.metrics.step_errors.inc()
            for seq in list(self.engine.running) + list(self.engine.waiting):
                self.engine.abort(seq.key)
            for request_id in list(self._live):
                self._finish(request_id, "error", f"engine step failed: {str(e).splitlines()[0] if str(e) else e!r}")
            return
        t = time.perf_counter()
        self.steps += 1
        events: dict[str, list[Event]] = {}
        for key, tok in out.tokens:
            live = self._live.get(key)
            if live is None:
                continue
            r = live.result
            if r.first_token_s is None:
                r.first_token_s = t - self._t0
            elif live.last_token_t is not None:
                r.itl_ms.append((t - live.last_token_t) * 1e3)
            live.last_token_t = t
            r.output_tokens += 1
            events.setdefault(key, []).append(Event("token", token=tok, t=t))
        ended = {seq.key: seq.finish_reason or "length" for seq in out.finished if seq.key in self._live}
        for key, reason in ended.items():
            events.setdefault(key, []).append(Event("done", reason=reason, t=t))
        self._send_all({key: tuple(evs) for key, evs in events.items()})
        for key, reason in ended.items():
            self._finish(key, reason, t=t, notify=False)
        if self.metrics is not None:
            self.metrics.steps.inc()
            self.metrics.step.observe(out.duration_s)
            self.metrics.generation_tokens.inc(len(out.tokens))
            self._count_tiers()

    def _send(self, request_id: str, events: tuple[Event, ...]) -> None:
        self._send_all({request_id: events})

    def _send_all(self, batch: dict[str, tuple[Event, ...]]) -> None:
        live = {k: self._live[k] for k in batch if k in self._live}
        if not live:
            return
        try:
            if self.dispatch is not None:
                self.dispatch([(lv.sink, batch[k]) for k, lv in live.items()])
                return
        except Exception as e:  # the HTTP side is gone (its event loop closed, ...)
            self._undeliverable(list(live), e)
            return
        for k, lv in live.items():
            try:
                lv.sink(batch[k])
            except Exception as e:
                self._undeliverable([k], e)

    def _undeliverable(self, request_ids: list[str], e: Exception) -> None:
        for request_id in request_ids:
            log.info("request %s: cannot deliver (%s); aborting it", request_id, e)
            self.engine.abort(request_id)
            self._finish(request_id, "abort", notify=False)

    def _finish(self, request_id: str, reason: str, message: str = "", *, t: float | None = None,
                notify: bool = True) -> None:
        if notify:
            kind = "error" if reason == "error" else "done"
            self._send(request_id, (Event(kind, reason=message if kind == "error" else reason,
                                          t=t or time.perf_counter()),))
        live = self._live.pop(request_id, None)
        with self._lock:
            self._outstanding.discard(request_id)
        if live is None:
            return
        live.result.finish_s = (t or time.perf_counter()) - self._t0
        live.result.finish_reason = reason
        if self.metrics is not None:
            self.metrics.finished(live.result, reason)

    def _gauges(self) -> None:
        if self.metrics is not None:
            running, waiting = self.counts()
            self.metrics.running.set(running)
            self.metrics.waiting.set(waiting)

    def _tier_counts(self) -> dict[str, int]:
        hybrid = self.engine.model.hybrid
        if hybrid is None:
            # Every expert resident as loaded: each (layer, expert) that ran in a step is one fast-tier call.
            return {"fast_hi": self.engine.model.stats.distinct_experts, "fetched_bytes": 0}
        st = hybrid.stats
        return {"fast_hi": st.expert_calls_fast_hi, "fast_lo": st.expert_calls_fast_lo, "host": st.expert_calls_host,
                "fetched": st.expert_calls_fetched, "replica": st.replica_calls, "fetched_bytes": st.bytes_to_fast}

    def _count_tiers(self) -> None:
        assert self.metrics is not None
        now = self._tier_counts()
        for k, v in now.items():
            delta = v - self._tier_seen.get(k, 0)
            if k == "fetched_bytes":
                if delta > 0:
                    self.metrics.fetched_bytes.inc(delta)
            else:
                self.metrics.expert_calls(k, delta)
        self._tier_seen = now
