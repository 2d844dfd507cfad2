"""Replay a recorded workload against any OpenAI-compatible server, measured as ``engine run`` measures.

Each request is sent at its recorded arrival (divided by ``rate_scale``; all at t=0 offline) to
``POST {url}/completions`` with ``stream: true``, over its own connection (httpx, asyncio). Its
timeline is an ``engine.results.RequestResult`` (arrival, first token, each token, last token), so
TTFT, TPOT, ITL, E2E and the run's percentiles come from the same code as an in-process run
(``RequestResult`` properties, ``RunResult.summary``).

Prompts are the workload's token ids (``Request.prompt_token_ids``, the very ids ``engine run``
feeds the engine) where the server takes token-id prompts; otherwise text of the recorded length
made from the model's ``tokenizer.json``. Either way the server's ``usage`` is checked against the
recorded prompt and output lengths, and every mismatch is reported.

A streamed chunk with a choice counts as one token (one chunk per token is what moetune and vLLM
send); where ``usage.completion_tokens`` says otherwise, the request's output count is the server's
and the request is listed in ``meta["token_count_from_usage"]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from engine.results import RequestResult, RunResult
from workloads.errors import WorkloadError
from workloads.schema import Request, Workload

log = logging.getLogger(__name__)

PromptFormat = Literal["auto", "ids", "text"]
_CONNECT_TIMEOUT_S = 10.0
_WORD = re.compile(r"^ [A-Za-z]+$")


# ------------------------------------------------------------------------------ the server


@dataclass
class ServerInfo:
    """What ``GET {url}/models`` said, and what it implies for the replay."""

    url: str
    model: str
    models: dict[str, Any]  # the whole answer
    card: dict[str, Any]  # the entry of ``model``

    @property
    def moetune(self) -> dict[str, Any] | None:
        """moetune's extension of its model card (config, identity, vocabulary), if the server is moetune."""
        ext = self.card.get("moetune")
        return ext if isinstance(ext, dict) else None


def normalise_url(url: str) -> str:
    """The API base without a trailing slash; one line naming the URL when it is not http(s)."""
    if not re.match(r"^https?://[^/\s]+", url or ""):
        raise WorkloadError(f"--url {url!r}: expected http://HOST:PORT/v1 (the server's OpenAI API base)")
    return url.rstrip("/")


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error_text(resp: Any) -> str:
    """``HTTP 400: message`` from an OpenAI-style error body, or the body's start."""
    try:
        body = resp.json()
        msg = body["error"]["message"] if isinstance(body.get("error"), dict) else body.get("error") or body
    except (ValueError, KeyError, TypeError, AttributeError):
        msg = resp.text[:200]
    return f"HTTP {resp.status_code}: {' '.join(str(msg).split())}"


async def fetch_server_info(client: Any, url: str, model: str | None, api_key: str | None) -> ServerInfo:
    import httpx

    try:
        resp = await client.get(f"{url}/models", headers=_headers(api_key))
    except httpx.HTTPError as e:
        raise WorkloadError(f"--url {url}: cannot reach the server ({type(e).__name__}: {e})") from None
    if resp.status_code != 200:
        hint = " (is the URL the API base, ending in /v1?)" if resp.status_code == 404 else ""
        raise WorkloadError(f"--url {url}: GET /models answered {_error_text(resp)}{hint}")
    try:
        answer = resp.json()
        cards = [c for c in answer["data"] if isinstance(c, dict) and isinstance(c.get("id"), str)]
    except (ValueError, KeyError, TypeError):
        raise WorkloadError(f"--url {url}: GET /models is not an OpenAI model list") from None
    if not cards:
        raise WorkloadError(f"--url {url}: GET /models lists no model")
    if model is None:
        card = cards[0]
    else:
        card = next((c for c in cards if c["id"] == model), None)
        if card is None:
            raise WorkloadError(f"--model {model!r}: the server serves {', '.join(c['id'] for c in cards)}")
    return ServerInfo(url, card["id"], answer, card)


# ------------------------------------------------------------------------------ the client's sockets


def _asyncio_backend():
    """An httpcore network backend on asyncio streams.

    httpx's default (anyio) stream pauses the socket's reading after every receive and resumes it
    before the next, two epoll calls per streamed chunk: measured here at about 270 us of client CPU per
    token, four times what the server spends on it. asyncio's streams keep reading while their buffer
    has room, so a chunk costs one ``data_received``. Plain http:// only; https keeps httpx's default.
    """
    import httpcore

    class Stream(httpcore.AsyncNetworkStream):
        def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
            self.reader, self.writer = reader, writer

        async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            try:
                if timeout is None:
                    return await self.reader.read(max_bytes)
                return await asyncio.wait_for(self.reader.read(max_bytes), timeout)
            except TimeoutError:
                raise httpcore.ReadTimeout(f"no data in {timeout} s") from None
            except OSError as e:
                raise httpcore.ReadError(str(e)) from e

        async def write(self, buffer: bytes, timeout: float | None = None) -> None:
            if not buffer:
                return
            try:
                self.writer.write(buffer)
                await asyncio.wait_for(self.writer.drain(), timeout)
            except TimeoutError:
                raise httpcore.WriteTimeout(f"could not send in {timeout} s") from None
            except OSError as e:
                raise httpcore.WriteError(str(e)) from e

        async def aclose(self) -> None:
            self.writer.close()
            with contextlib.suppress(OSError):  # the peer may have gone first
                await self.writer.wait_closed()

        async def start_tls(self, ssl_context, server_hostname=None, timeout=None):
            raise httpcore.UnsupportedProtocol("TLS is not handled by this backend")

        def get_extra_info(self, info: str) -> Any:
            if info == "is_readable":  # an idle keep-alive connection the server closed
                return self.reader.at_eof()
            if info == "socket":
                return self.writer.get_extra_info("socket")
            if info == "server_addr":
                return self.writer.get_extra_info("peername")
            if info == "client_addr":
                return self.writer.get_extra_info("sockname")
            return None

    class Backend(httpcore.AsyncNetworkBackend):
        async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
            except TimeoutError:
                raise httpcore.ConnectTimeout(f"no connection to {host}:{port} in {timeout} s") from None
            except OSError as e:
                raise httpcore.ConnectError(str(e)) from e
            return Stream(reader, writer)

        async def connect_unix_socket(self, path, timeout=None, socket_options=None):
            raise httpcore.UnsupportedProtocol("unix sockets are not handled by this backend")

        async def sleep(self, seconds: float) -> None:
            await asyncio.sleep(seconds)

    return Backend()


def _client(url: str):
    """An httpx client with one connection per in-flight request and no read timeout (long streams)."""
    import httpcore
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(_CONNECT_TIMEOUT_S, read=None, write=30.0, pool=None)
    transport = httpx.AsyncHTTPTransport(limits=limits)
    if url.startswith("http://"):
        # httpx takes no network backend; its transport's pool is replaced by one that has ours.
        transport._pool = httpcore.AsyncConnectionPool(  # type: ignore[attr-defined]
            max_connections=None, max_keepalive_connections=None, network_backend=_asyncio_backend())
    return httpx.AsyncClient(transport=transport, timeout=timeout)


# ------------------------------------------------------------------------------ prompts


class TextPrompts:
    """Text whose token count under the model's tokenizer is a given length.

    Built from the vocabulary's whole words (a token that decodes to " word" and encodes back to
    itself alone), so n words are n tokens plus the tokenizer's own special tokens; each request's
    words are picked by its synthetic token ids, so prompts differ as they do in an in-process run.
    """

    def __init__(self, tokenizer_dir: str | Path):
        from tokenizers import Tokenizer

        path = Path(tokenizer_dir) / "tokenizer.json"
        if not path.exists():
            raise WorkloadError(f"{path}: no such file (--tokenizer takes a directory holding tokenizer.json)")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers package raises its own exception type
            raise WorkloadError(f"{path}: not a readable tokenizer ({str(e).splitlines()[0]})") from None
        self.path = path
        self.words = []
        for tid in range(self.tokenizer.get_vocab_size()):
            w = self.tokenizer.decode([tid])
            if _WORD.match(w) and self.tokenizer.encode(w, add_special_tokens=False).ids == [tid]:
                self.words.append(w)
        if not self.words:
            raise WorkloadError(f"{path}: no whole-word tokens (' word') to build prompts of a given length from")
        self.n_special = len(self.tokenizer.encode("", add_special_tokens=True).ids)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def text(self, request_id: str, ids: list[int], n_tokens: int) -> str:
        k = n_tokens - self.n_special
        if k < 0:
            raise WorkloadError(f"request {request_id!r}: prompt_len {n_tokens} is shorter than the "
                                f"tokenizer's {self.n_special} special tokens")
        text = "".join(self.words[i % len(self.words)] for i in ids[:k])
        got = len(self.tokenizer.encode(text, add_special_tokens=True).ids)
        if got != n_tokens:
            raise WorkloadError(f"request {request_id!r}: text of {k} words encodes to {got} tokens, not "
                                f"{n_tokens}, with {self.path}")
        return text


async def _takes_token_ids(client: Any, info: ServerInfo, api_key: str | None, vocab_size: int) -> tuple[bool, str]:
    """Whether ``/completions`` accepts a prompt of token ids (and counts them as such)."""
    ids = [min(5 + i, vocab_size - 1) for i in range(4)]
    body = {"model": info.model, "prompt": ids, "max_tokens": 1, "stream": False}
    resp = await client.post(f"{info.url}/completions", json=body, headers=_headers(api_key))
    if resp.status_code != 200:
        return False, _error_text(resp)
    usage = resp.json().get("usage") or {}
    if usage.get("prompt_tokens") != len(ids):
        return False, f"usage.prompt_tokens={usage.get('prompt_tokens')} for {len(ids)} token ids"
    return True, "accepted"


# ------------------------------------------------------------------------------ the replay


@dataclass
class ReplayOptions:
    mode: Literal["realtime", "offline"] = "realtime"
    rate_scale: float = 1.0
    max_requests: int | None = None
    prompts: PromptFormat = "auto"
    tokenizer_dir: str | None = None
    vocab_size: int | None = None
    seed: int | None = None
    ignore_eos: bool = True
    api_key: str | None = None


@dataclass
class _Outcome:
    result: RequestResult
    usage: dict[str, Any] | None = None
    chunks: int = 0
    error: str | None = None
    server_finish: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _request_body(model: str, prompt: str | list[int], r: Request, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": r.max_new_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # replay the recorded output lengths (vLLM's and moetune's extension)
    return body


async def _one(client: Any, url: str, body: dict[str, Any], headers: dict[str, str], out: _Outcome,
               due: float, t0: float, on_done: Callable[[], None] | None) -> None:
    import httpx

    await asyncio.sleep(max(0.0, due - time.perf_counter()))
    res = out.result
    last: float | None = None
    try:
        async with client.stream("POST", f"{url}/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                out.error = _error_text(resp)
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    out.error = f"a stream chunk is not JSON: {data[:80]!r}"
                    return
                if "error" in obj:
                    err = obj["error"]
                    out.error = "in the stream: " + str(err.get("message") if isinstance(err, dict) else err)
                    return
                choices = obj.get("choices") or []
                if choices:
                    out.chunks += 1
                    if res.first_token_s is None:
                        res.first_token_s = now
                    elif last is not None:
                        res.itl_ms.append((now - last) * 1e3)
                    last = now
                    out.server_finish = choices[0].get("finish_reason") or out.server_finish
                if obj.get("usage"):
                    out.usage = obj["usage"]
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        if out.error is None and last is not None:
            res.finish_s = last
            res.output_tokens = out.chunks
            res.finish_reason = "eos" if out.server_finish == "stop" else "length"
        elif out.error is None:
            out.error = "the stream ended without a token"
        if out.error is not None:
            res.finish_reason = "rejected"
        if on_done is not None:
            on_done()


async def replay_async(url: str, workload: Workload, model: str | None = None, options: ReplayOptions | None = None,
                       on_done: Callable[[], None] | None = None) -> RunResult:
    """Replay ``workload`` against the server at ``url`` (its OpenAI API base); see the module doc."""

    from engine.config import RuntimeConfig

    o = options or ReplayOptions()
    if o.rate_scale <= 0:
        raise WorkloadError(f"--rate-scale {o.rate_scale}: must be > 0")
    url = normalise_url(url)
    requests = list(workload.requests)[: o.max_requests or None]
    async with _client(url) as client:
        info = await fetch_server_info(client, url, model, o.api_key)
        ext = info.moetune or {}
        text = TextPrompts(o.tokenizer_dir) if o.tokenizer_dir else None
        vocab = o.vocab_size or ext.get("vocab_size") or (text.vocab_size if text else None)
        server_seed = ((ext.get("config") or {}).get("runtime") or {}).get("seed")
        seed = o.seed if o.seed is not None else server_seed if server_seed is not None else RuntimeConfig().seed
        if vocab is None:
            raise WorkloadError("the server does not say its vocabulary size: give --vocab-size or --tokenizer")
        fmt, why = o.prompts, "as asked"
        if fmt == "auto":
            if ext.get("token_id_prompts"):
                fmt, why = "ids", "the server says it takes token ids"
            else:
                ok, why = await _takes_token_ids(client, info, o.api_key, vocab)
                fmt = "ids" if ok else "text"
        if fmt == "text" and text is None:
            reason = "--prompts text" if o.prompts == "text" else f"the server does not take token-id prompts ({why})"
            raise WorkloadError(f"{reason}: give --tokenizer DIR (the model's tokenizer.json) to make the text")
        bodies, outcomes = [], []
        for r in requests:
            ids = r.prompt_token_ids(vocab, seed)
            prompt: str | list[int] = ids if fmt == "ids" else text.text(r.request_id, ids, r.prompt_len)  # type: ignore[union-attr]
            bodies.append(_request_body(info.model, prompt, r, o.ignore_eos))
            arrival = 0.0 if o.mode == "offline" else r.arrival_s / o.rate_scale
            outcomes.append(_Outcome(RequestResult(r.request_id, arrival, r.prompt_len, 0, None, None, [], "",
                                                   r.tag)))
        headers = _headers(o.api_key)
        t0 = time.perf_counter()
        started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        await asyncio.gather(*(_one(client, url, b, headers, out, t0 + out.result.arrival_s, t0, on_done)
                               for b, out in zip(bodies, outcomes, strict=True)))
        duration_s = time.perf_counter() - t0
    meta = _meta(info, workload, o, fmt, why, seed, vocab, outcomes, started_at)
    return RunResult(meta=meta, requests=[out.result for out in outcomes], steps=[], telemetry=[], expert_stats=[],
                     duration_s=duration_s, peak_rss_bytes=None)  # type: ignore[arg-type]  # not seen over HTTP


def replay(url: str, workload: Workload, model: str | None = None, options: ReplayOptions | None = None,
           on_done: Callable[[], None] | None = None) -> RunResult:
    """:func:`replay_async` on a fresh uvloop event loop (libuv's: less client CPU per streamed chunk)."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        result = runner.run(replay_async(url, workload, model, options, on_done))
    result.meta["client"] = {"event_loop": "uvloop", "http": "httpx on asyncio streams"
                             if url.startswith("http://") else "httpx"}
    return result


def _meta(info: ServerInfo, workload: Workload, o: ReplayOptions, fmt: str, why: str, seed: int, vocab: int,
          outcomes: list[_Outcome], started_at: str) -> dict[str, Any]:
    from engine.hwinfo import hardware, software

    ext = info.moetune or {}
    prompt_mismatch, output_mismatch, from_usage, errors = {}, {}, [], {}
    for out in outcomes:
        r = out.result
        if out.error is not None:
            errors[r.request_id] = out.error
            continue
        usage = out.usage or {}
        if usage.get("prompt_tokens") is not None and usage["prompt_tokens"] != r.prompt_tokens:
            prompt_mismatch[r.request_id] = {"recorded": r.prompt_tokens, "server": usage["prompt_tokens"]}
        if usage.get("completion_tokens") is not None and usage["completion_tokens"] != out.chunks:
            from_usage.append(r.request_id)
            r.output_tokens = int(usage["completion_tokens"])
    by_id = {r.request_id: r for r in workload.requests}
    for out in outcomes:
        r = out.result
        want = by_id[r.request_id].max_new_tokens
        if out.error is None and o.ignore_eos and r.output_tokens != want:
            output_mismatch[r.request_id] = {"recorded": want, "server": r.output_tokens}
    for what, bad in (("prompt", prompt_mismatch), ("output", output_mismatch)):
        if bad:
            rid, v = next(iter(bad.items()))
            log.warning("%d requests' %s lengths differ from the workload's (first: %s, %d recorded, %d by the "
                        "server)", len(bad), what, rid, v["recorded"], v["server"])
    if errors:
        rid, e = next(iter(errors.items()))
        log.warning("%d requests failed (first: %s: %s)", len(errors), rid, e)
    return {
        "backend": "http",
        "server": {"url": info.url, "model": info.model, "models": info.models},
        "model": {"path": info.card.get("root") or info.model, "arch": ext.get("arch"),
                  "identity": ext.get("identity"), "fingerprint": (ext.get("identity") or {}).get("fingerprint")},
        "workload": {"name": workload.name, "requests": len(workload.requests)},
        "mode": o.mode,
        "rate_scale": o.rate_scale,
        "config": ext.get("config"),
        "config_hash": ext.get("config_hash"),
        "device": ext.get("device"),
        "compute_dtype": ext.get("compute_dtype"),
        "cpu_kernels": ext.get("cpu_kernels"),
        "prompts": {"format": fmt, "why": why, "seed": seed, "vocab_size": vocab,
                    "tokenizer": o.tokenizer_dir, "ignore_eos_sent": o.ignore_eos},
        "prompt_length_mismatch": prompt_mismatch,
        "output_length_mismatch": output_mismatch,
        "token_count_from_usage": from_usage,
        "errors": errors,
        "hardware": ext.get("hardware"),
        "client_hardware": hardware(),
        "software": software(),
        "started_at": started_at,
        "not_measured": ["steps", "telemetry", "expert_stats", "peak_rss_bytes"],
    }


# ------------------------------------------------------------------------------ the database


def record_replay(db_url: str | None, result: RunResult, workload: Workload, workload_spec: str,
                  study: str | None = None, slo: Mapping[str, Any] | None = None) -> tuple[str, int]:
    """Store a replay as a complete trial of an ``http`` study; returns (study name, trial id).

    The study is ``http-<model>-<workload>`` unless named; each replay adds a trial. Its config is the
    moetune server's engine config where the server reports one.
    """
    from sqlalchemy import func, select

    from db.models import Trial
    from db.session import make_engine, resolve_url, session_scope, upgrade
    from db.store import (
        create_study,
        finish_trial,
        get_or_create_model,
        get_or_create_workload,
        stable_hash,
        start_trial,
    )
    from tuner.record import workload_fingerprint
    from tuner.slo import evaluate, parse_slo

    meta = result.meta
    server = meta["server"]
    card = next((c for c in server["models"].get("data", []) if c.get("id") == server["model"]), {})
    stable_card = {k: v for k, v in card.items() if k != "created"}
    identity = dict(meta["model"].get("identity") or {})
    identity.update({"path": meta["model"]["path"], "model": server["model"], "served_by": card.get("owned_by")})
    if not identity.get("fingerprint"):
        identity["fingerprint"] = stable_hash({"model": server["model"], "card": stable_card})
    config = meta.get("config") or {"http": {"model": server["model"], "owned_by": card.get("owned_by")}}
    config_hash = meta.get("config_hash") or stable_hash(config)
    name = study or re.sub(r"[^A-Za-z0-9._-]+", "_", f"http-{server['model']}-{workload.name}").strip("_")
    spec = parse_slo((), dict(slo or {}))
    url = resolve_url(db_url)
    upgrade(url)
    engine = make_engine(url)
    backend = "http"  # the study's results come from a server measured over HTTP (db.models.BACKENDS)
    hardware = meta.get("hardware") or {"reported_by_server": False, "url": server["url"]}
    result_dict = result.to_dict()
    result_dict["meta"] = {**meta, "study_backend": backend}
    with session_scope(engine) as s:
        model_id = get_or_create_model(s, identity)
        workload_id = get_or_create_workload(s, workload.name, source=workload_spec, n_requests=len(workload.requests),
                                             duration_s=workload.duration_s, metadata=workload.metadata,
                                             fingerprint=workload_fingerprint(workload))
        study_id = create_study(s, name, model_id=model_id, workload_id=workload_id, backend=backend,
                                search_space_hash="http-replay", objectives=[], slo=spec.to_dict(),
                                hardware=hardware, software={"client": meta["software"],
                                                             "server": card.get("owned_by")},
                                optuna_study_name=name)
        last = s.scalar(select(func.max(Trial.number)).where(Trial.study_id == study_id))
        number = 0 if last is None else last + 1
        trial_id = start_trial(s, study_id, number, config, config_hash)
        kwargs: dict[str, Any] = {}
        if spec.bounds:
            ev = evaluate(result.requests, result.summary(), result.duration_s, spec)
            kwargs = {"slo_attainment": ev.attainment, "goodput_rps": ev.goodput_rps, "met_slo_per_request": ev.met}
        finish_trial(s, trial_id, result_dict, "complete", **kwargs)
    engine.dispose()
    return name, trial_id
