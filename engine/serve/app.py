"""The OpenAI-compatible HTTP API (FastAPI on uvicorn) in front of one :class:`EngineLoop`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamed as server-sent
events with ``stream: true``, ending ``data: [DONE]``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus). Handlers parse, tokenize, queue the request with the loop and stream
what it produces; they never touch the engine. A client that disconnects aborts its request, which
frees its KV cache slot. Every error is an OpenAI-style body ``{"error": {"message", "type",
"param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.serve.config import ServeConfig
from engine.serve.loop import EngineLoop, Event, QueueFull, SamplingParams
from engine.serve.metrics import ServeMetrics
from engine.serve.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    bad_request,
    parse_body,
)
from engine.serve.text import Detokenizer, ModelText, StopMatcher, TemplateInputError, TextError

log = logging.getLogger(__name__)

UNAUTHENTICATED_PATHS = ("/health",)


@dataclass
class Piece:
    """What one generated token adds to a choice: text (maybe empty while held back), its id, and the
    finish reason on the last one."""

    text: str
    token: int | None
    finish_reason: str | None = None


class _Handle:
    """The HTTP side of one queued request: its events, and abort on the way out."""

    def __init__(self, loop: EngineLoop, request_id: str):
        self.loop, self.request_id = loop, request_id
        self.queue: asyncio.Queue[tuple[Event, ...]] = asyncio.Queue()
        self.sink: Callable[[tuple[Event, ...]], None] = self.queue.put_nowait  # called on the event loop
        self.finished = False
        self.completion_tokens = 0

    def close(self, reason: str = "abort") -> None:
        """Abort the request unless it finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self.loop.abort(self.request_id, reason)

    async def pieces(self, text: ModelText | None, stops: list[str]) -> AsyncIterator[Piece]:
        """One piece per generated token; the last carries the finish reason."""
        det, stop = Detokenizer(text), StopMatcher(stops)
        while True:
            batch = await self.queue.get()
            for i, ev in enumerate(batch):
                if ev.kind == "error":
                    self.finished = True
                    raise ApiError(500, f"generation failed: {ev.reason}")
                nxt = batch[i + 1] if i + 1 < len(batch) else None
                if ev.kind == "done":  # ended with no token in this step
                    self.finished = True
                    tail = stop.feed(det.flush())
                    yield Piece(tail.text + ("" if tail.stopped else stop.flush()), None,
                                _finish_reason(ev.reason, tail.stopped))
                    return
                self.completion_tokens += 1
                last = nxt is not None and nxt.kind == "done"
                piece = det.push(ev.token) + (det.flush() if last else "")
                r = stop.feed(piece)
                if r.stopped:
                    self.close("stop")  # frees the slot now; the engine may have produced more already
                    yield Piece(r.text, ev.token, "stop")
                    return
                if last:
                    assert nxt is not None
                    self.finished = True
                    yield Piece(r.text + stop.flush(), ev.token, _finish_reason(nxt.reason, False))
                    return
                yield Piece(r.text, ev.token)


def _deliver(items: list[tuple[Callable[[tuple[Event, ...]], None], tuple[Event, ...]]]) -> None:
    for sink, events in items:
        sink(events)


def _finish_reason(engine_reason: str, stopped: bool) -> str:
    """The OpenAI API's finish reason: "stop" (end of sequence or a stop string) or "length"."""
    return "stop" if stopped or engine_reason in ("eos", "stop") else "length"


class _EventStream(Response):
    """Server-sent events that watch for the client going away (whatever the ASGI spec version) and
    abort the request then."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], handle: _Handle):
        # No Response.__init__: it would declare a Content-Length for an empty body.
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.chunks, self.handle = chunks, handle

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async with anyio.create_task_group() as tg:
                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    log.info("request %s: client disconnected; aborting", self.handle.request_id)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                async for chunk in self.chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        finally:
            self.handle.close()
            await self.chunks.aclose()  # type: ignore[attr-defined]


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _Guard:
    """ASGI middleware: ``Authorization: Bearer <key>`` on every route but /health when a key is set."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.api_key and scope["path"] not in UNAUTHENTICATED_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key.encode()):
                msg = "missing or wrong API key: send 'Authorization: Bearer <key>'"
                err = ApiError(401, msg, code="invalid_api_key")
                await JSONResponse(err.body(), 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Server:
    """The served model: engine loop, text side, settings, metrics; builds the ASGI app."""

    def __init__(self, loop: EngineLoop, text: ModelText | None, settings: ServeConfig, model_name: str,
                 metrics: ServeMetrics, api_key: str | None = None, hardware: dict[str, Any] | None = None):
        self.loop, self.text, self.settings, self.model_name = loop, text, settings, model_name
        self.metrics, self.api_key, self.hardware = metrics, api_key, hardware or {}
        self.created = int(time.time())
        self._aio: asyncio.AbstractEventLoop | None = None
        loop.dispatch = self._dispatch
        if text is not None and text.vocab_size > loop.info.vocab_size:
            raise TextError(f"{loop.info.path}/tokenizer.json has {text.vocab_size} tokens; the model's "
                            f"vocabulary has only {loop.info.vocab_size}")

    # ------------------------------------------------------------------ the app
    def app(self):
        api = FastAPI(title="moetune", docs_url=None, redoc_url=None, openapi_url=None)

        @api.exception_handler(ApiError)
        async def _api_error(_request: Request, e: ApiError):
            return JSONResponse(e.body(), e.status, headers=e.headers)

        @api.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, e: StarletteHTTPException):
            msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
            return JSONResponse(ApiError(e.status_code, msg).body(), e.status_code, headers=e.headers)

        @api.exception_handler(Exception)
        async def _internal(_request: Request, e: Exception):
            log.exception("internal error")
            return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}").body(), 500)

        @api.get("/health")
        async def health():
            if not self.loop.alive:
                raise ApiError(503, "the engine loop is not running", type_="server_error")
            return {"status": "ok"}

        @api.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @api.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self.model_card()]}

        @api.get("/v1/models/{model_id:path}")
        async def model(model_id: str):
            self._check_model(model_id, param=None)
            return self.model_card()

        @api.post("/v1/completions")
        async def completions(request: Request):
            arrival = time.perf_counter()
            req: CompletionRequest = parse_body(await self._body(request), CompletionRequest)
            self._check_model(req.model)
            if isinstance(req.prompt, str):
                if self.text is None:
                    raise bad_request("this model has no tokenizer.json: send the prompt as token ids", "prompt")
                prompt = self.text.encode(req.prompt)
            else:
                prompt = req.prompt
            max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
            return await self._generate(request, req, "completion", prompt, max_tokens, "prompt", arrival)

        @api.post("/v1/chat/completions")
        async def chat(request: Request):
            arrival = time.perf_counter()
            req: ChatRequest = parse_body(await self._body(request), ChatRequest)
            self._check_model(req.model)
            if self.text is None or self.text.template is None:
                raise bad_request("this model has no chat template (tokenizer_config.json 'chat_template'); "
                                  "use /v1/completions", "messages")
            messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                        for m in req.messages]
            try:
                prompt = self.text.encode_chat(messages)
            except TemplateInputError as e:
                raise bad_request(str(e), "messages") from None
            except TextError as e:  # the template itself is at fault: the server's problem, not the client's
                raise ApiError(500, str(e)) from None
            return await self._generate(request, req, "chat", prompt, req.token_limit, "messages", arrival)

        return _Guard(api, self.api_key)

    def model_card(self) -> dict[str, Any]:
        info = self.loop.info
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "moetune",
                "root": info.path, "max_model_len": info.max_seq_len_tokens,
                "moetune": {"arch": info.arch, "vocab_size": info.vocab_size, "identity": info.identity,
                            "config_hash": info.config_hash, "config": info.config,
                            "max_batch_seqs": info.max_batch_seqs, "device": info.device,
                            "compute_dtype": info.compute_dtype, "cpu_kernels": info.cpu_kernels,
                            "hardware": self.hardware, "token_id_prompts": True,
                            "tokenizer": self.text is not None,
                            "chat_template": self.text is not None and self.text.template is not None}}

    # ------------------------------------------------------------------ request plumbing
    def _dispatch(self, items: list[tuple[Callable[[tuple[Event, ...]], None], tuple[Event, ...]]]) -> None:
        """From the engine loop's thread: one wake-up of the event loop per step, for every request."""
        if self._aio is None:
            raise RuntimeError("no request was ever queued from an event loop")
        self._aio.call_soon_threadsafe(_deliver, items)

    async def _body(self, request: Request) -> bytes:
        cap = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise bad_request(f"Content-Length {declared!r} is not a number")
            if int(declared) > cap:
                raise ApiError(413, f"the request body of {declared} bytes exceeds the limit of {cap} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > cap:
                raise ApiError(413, f"the request body exceeds the limit of {cap} bytes")
        return bytes(body)

    def _check_model(self, name: str, param: str | None = "model") -> None:
        if name != self.model_name:
            raise ApiError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           param=param, code="model_not_found")

    def _check_prompt(self, prompt: list[int], max_tokens: int | None, param: str) -> int:
        """Checks the token ids and the context; returns max_tokens (the context's rest where None)."""
        info = self.loop.info
        if not prompt:
            raise bad_request("the prompt is empty", param)
        bad = next((t for t in prompt if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the model's vocabulary of {info.vocab_size}", param,
                              "invalid_token_id")
        room = info.max_seq_len_tokens - len(prompt)
        if room < 1:
            raise bad_request(f"this model's maximum context length is {info.max_seq_len_tokens} tokens; the "
                              f"prompt has {len(prompt)}", param, "context_length_exceeded")
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise bad_request(f"this model's maximum context length is {info.max_seq_len_tokens} tokens; "
                              f"{len(prompt)} in the prompt + max_tokens={max_tokens} exceed it", "max_tokens",
                              "context_length_exceeded")
        return max_tokens

    async def _generate(self, request: Request, req: Any, kind: str, prompt: list[int], max_tokens: int | None,
                        prompt_param: str, arrival: float):
        max_tokens = self._check_prompt(prompt, max_tokens, prompt_param)
        sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p,
                                  top_k=None if req.top_k is None else max(req.top_k, 0),
                                  ignore_eos=req.ignore_eos, seed=req.seed)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self._aio = asyncio.get_running_loop()
        handle = _Handle(self.loop, rid)
        try:
            self.loop.submit(rid, prompt, max_tokens, sampling, handle.sink, arrival)
        except QueueFull as e:
            retry = str(self.settings.retry_after_s)
            raise ApiError(429, f"the server is busy: {e}; retry after {retry} s", code="queue_full",
                           headers={"Retry-After": retry}) from None
        stops = req.stops()
        if req.stream:
            return _EventStream(self._stream(handle, req, kind, prompt, stops), handle)
        return await self._complete(request, handle, req, kind, prompt, stops)

    def _usage(self, prompt: list[int], handle: _Handle) -> dict[str, int]:
        n = handle.completion_tokens
        return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}

    async def _complete(self, request: Request, handle: _Handle, req: Any, kind: str, prompt: list[int],
                        stops: list[str]) -> dict[str, Any]:
        text, ids, finish = [], [], None
        failed: ApiError | None = None

        async def collect() -> None:
            nonlocal finish, failed
            try:
                async for p in handle.pieces(self.text, stops):
                    text.append(p.text)
                    if p.token is not None:
                        ids.append(p.token)
                    finish = p.finish_reason
            except ApiError as e:  # raised below, outside the task group (which would wrap it)
                failed = e

        gone = False
        try:
            async with anyio.create_task_group() as tg:
                async def watch() -> None:
                    nonlocal gone
                    while (await request.receive())["type"] != "http.disconnect":
                        pass
                    gone = True
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                await collect()
                tg.cancel_scope.cancel()
        finally:
            handle.close()
        if gone:
            log.info("request %s: client disconnected; aborted", handle.request_id)
            return Response(status_code=499)
        if failed is not None:
            raise failed
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": "".join(text)}
            obj = "chat.completion"
        else:
            choice["text"] = "".join(text)
            obj = "text_completion"
        if req.return_token_ids:
            choice["token_ids"] = ids
            choice["prompt_token_ids"] = list(prompt)
        return {"id": handle.request_id, "object": obj, "created": int(time.time()), "model": self.model_name,
                "choices": [choice], "usage": self._usage(prompt, handle),
                "system_fingerprint": self.loop.info.config_hash}

    async def _stream(self, handle: _Handle, req: Any, kind: str, prompt: list[int],
                      stops: list[str]) -> AsyncIterator[bytes]:
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        base = {"id": handle.request_id, "object": obj, "created": created, "model": self.model_name,
                "system_fingerprint": self.loop.info.config_hash}
        if kind == "chat":
            yield _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        try:
            async for p in handle.pieces(self.text, stops):
                choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": p.finish_reason}
                if kind == "chat":
                    choice["delta"] = {"content": p.text} if p.text or p.token is not None else {}
                else:
                    choice["text"] = p.text
                if req.return_token_ids:
                    choice["token_ids"] = [] if p.token is None else [p.token]
                yield _sse({**base, "choices": [choice]})
        except ApiError as e:  # headers are sent: the error goes in the stream, as OpenAI's API does
            yield _sse(e.body())
        if req.include_usage:
            yield _sse({**base, "choices": [], "usage": self._usage(prompt, handle)})
        yield b"data: [DONE]\n\n"


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port); IPv4 or IPv6 as the host says."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.set_inheritable(True)
    return sock


def lower_this_thread(nice: int) -> None:
    """Raise the calling thread's niceness by ``nice`` (Linux threads each have their own)."""
    if nice > 0:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)


def uvicorn_server(app, settings: ServeConfig):
    """A uvicorn server for ``app`` with the settings' logging (run it with ``sockets=[bind_socket(...)]``)."""
    import uvicorn

    # uvloop and httptools (uvicorn's "standard" extras) halve the server's CPU per streamed token here.
    config = uvicorn.Config(app, loop="uvloop", http="httptools", log_level=settings.log_level,
                            access_log=settings.access_log, timeout_graceful_shutdown=5, lifespan="off")
    return uvicorn.Server(config)


def make_server(engine, settings: ServeConfig, model_name: str, api_key: str | None = None) -> Server:
    """The server for a loaded ``engine.runtime.Engine`` (its loop not yet started)."""
    from engine.hwinfo import hardware
    from engine.serve.text import load_text

    metrics = ServeMetrics(model_name)
    loop = EngineLoop(engine, max_waiting=settings.max_waiting_requests, metrics=metrics)
    return Server(loop, load_text(loop.info.path), settings, model_name, metrics, api_key, hardware())
