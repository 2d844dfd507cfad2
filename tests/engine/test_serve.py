"""`engine serve` through the official `openai` client and raw HTTP, on a real uvicorn server.

Each server runs in a thread of the test process on a free port of 127.0.0.1, over a tiny model the
tests make (with the maker's tokenizer and chat template). Greedy tokens are checked against the
engine's own offline generation of the same prompts.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.runtime import Engine
from engine.serve.testing import serving
from engine.serve.text import ModelText

MODEL = "tiny-test"
CONFIG = dict(max_batch_seqs=8, max_batch_tokens=256, prefill_chunk_tokens=64, max_seq_len_tokens=512)


@pytest.fixture(scope="module")
def model_dir(make_ckpt):
    return make_ckpt("qwen3_moe")


@pytest.fixture(scope="module")
def text(model_dir):
    return ModelText(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    engine = Engine(model_dir, EngineConfig().replace(**CONFIG))
    with serving(engine, MODEL) as (url, srv):
        yield url, srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy tokens of the engine alone (what `engine generate` prints), one prompt at a time."""
    engine = Engine(model_dir, EngineConfig().replace(**CONFIG))
    return lambda prompt, n: engine.generate([prompt], n)[0]


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url.removesuffix("/v1") + "/metrics").text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# ------------------------------------------------------------------------------ the happy paths


def test_models_and_health(server, client):
    url, srv = server
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = models.data[0].model_extra
    assert card["max_model_len"] == CONFIG["max_seq_len_tokens"]
    assert card["moetune"]["config_hash"] == srv.loop.info.config_hash
    assert card["moetune"]["vocab_size"] == 512 and card["moetune"]["tokenizer"] is True
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(url.removesuffix("/v1") + "/health").json() == {"status": "ok"}


def test_completion_text_and_ids(client, text, reference):
    prompt = "Hello there, bako tefi"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0,
                                    extra_body={"return_token_ids": True})
    ids = text.encode(prompt)
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 7
    assert out.usage.total_tokens == len(ids) + 7
    assert choice.model_extra["token_ids"] == reference(ids, 7)
    assert choice.text == text.decode(reference(ids, 7))
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=7)  # the API's token-id prompt
    assert by_ids.choices[0].text == choice.text and by_ids.usage.prompt_tokens == len(ids)


def test_completion_streamed_equals_unstreamed(client):
    kwargs = dict(model=MODEL, prompt="stream me", max_tokens=9, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == 9  # one chunk per token; the last carries the finish reason
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 8 + ["length"]
    assert "".join(c.choices[0].text for c in token_chunks) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_streamed_and_not(client, text, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, how are you?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    ids = text.encode_chat(messages)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == text.decode(reference(ids, 8))
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == len(ids) + 8


def test_chat_template_matches_transformers(model_dir, text, hf):
    """The sandboxed rendering gives the ids transformers' own apply_chat_template gives."""
    tok = hf.transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "Hello!"},
                {"role": "assistant", "content": "bako"}, {"role": "user", "content": "again"}]
    theirs = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert text.encode_chat(messages) == list(theirs)


def test_eight_concurrent_streams_equal_engine_generate(server, text, reference):
    url, srv = server
    prompts = [text.encode(t) for t in ("one", "two words", "a somewhat longer prompt here", "bako tefimo")]
    prompts += [[5 + i * 7 + j for j in range(3 + 9 * i)] for i in range(4)]  # token ids, 3..30 long
    lengths = [5, 12, 7, 16, 9, 3, 14, 11]

    async def one(aclient, prompt, n):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                                  stream=True, extra_body={"return_token_ids": True})
        return [t async for c in stream for t in c.choices[0].model_extra["token_ids"]]

    async def main():
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, p, n) for p, n in zip(prompts, lengths, strict=True)))

    steps_before = srv.loop.steps
    got = asyncio.run(main())
    for prompt, n, tokens in zip(prompts, lengths, got, strict=True):
        assert tokens == reference(prompt, n)
    # They shared steps (continuous batching): one request after another would need a step per token.
    assert srv.loop.steps - steps_before < sum(lengths)


def test_stop_strings_end_the_text_and_free_the_request(client):
    base = client.completions.create(model=MODEL, prompt="stop test", max_tokens=12, temperature=0).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 2]
    cut = base[: base.index(stop)]
    out = client.completions.create(model=MODEL, prompt="stop test", max_tokens=12, temperature=0, stop=[stop])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 12
    streamed = client.completions.create(model=MODEL, prompt="stop test", max_tokens=12, temperature=0, stop=stop,
                                         stream=True)
    chunks = [c for c in streamed if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_per_request(client, text, reference):
    kw = dict(model=MODEL, prompt="sample", max_tokens=10, extra_body={"return_token_ids": True})
    a = client.completions.create(**kw, temperature=1.0, seed=7).choices[0].model_extra["token_ids"]
    b = client.completions.create(**kw, temperature=1.0, seed=7).choices[0].model_extra["token_ids"]
    c = client.completions.create(**kw, temperature=1.0, seed=8).choices[0].model_extra["token_ids"]
    assert a == b and a != c
    top1 = client.completions.create(model=MODEL, prompt="sample", max_tokens=10, temperature=1.0, seed=3,
                                     extra_body={"top_k": 1, "return_token_ids": True})
    assert top1.choices[0].model_extra["token_ids"] == reference(text.encode("sample"), 10)


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=4)
    m = metrics(server[0])
    assert m[("moetune:time_to_first_token_seconds_count", ())] >= 1
    assert m[("moetune:time_per_output_token_seconds_count", ())] >= 1
    assert m[("moetune:e2e_request_latency_seconds_count", ())] >= 1
    assert m[("moetune:prompt_tokens_total", ())] > 0 and m[("moetune:generation_tokens_total", ())] >= 4
    assert m[("moetune:expert_calls_total", (("tier", "fast_hi"),))] > 0
    assert m[("moetune:expert_calls_total", (("tier", "host"),))] == 0
    assert ("moetune:fetched_bytes_total", ()) in m
    assert m[("moetune:num_requests_running", ())] == 0 and m[("moetune:num_requests_waiting", ())] == 0


# ------------------------------------------------------------------------------ bad input


def post(url: str, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=30, **kw)


LONG = [7] * 600  # longer than the 512-token context


@pytest.mark.parametrize(("path", "body", "status", "param", "needle"), [
    ("/completions", b'{"model": "tiny-test", "prompt": "x"', 400, None, "not valid JSON"),
    ("/completions", [1, 2], 400, None, "JSON object"),
    ("/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ("/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature", "valid number"),
    ("/completions", {"model": MODEL, "prompt": "x", "stream": 1}, 400, "stream", "boolean"),
    ("/completions", {"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "frobnicate", "unrecognized"),
    ("/completions", {"model": MODEL}, 400, "prompt", "required"),
    ("/completions", {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt", "string or a list"),
    ("/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    ("/completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt", "outside the model's vocabulary"),
    ("/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n", "n=1"),
    ("/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("/completions", {"model": MODEL, "prompt": "x", "temperature": 3}, 400, "temperature", "between 0 and 2"),
    ("/completions", {"model": MODEL, "prompt": "x", "logprobs": 2}, 400, "logprobs", "not supported"),
    ("/completions", {"model": MODEL, "prompt": LONG}, 400, "prompt", "maximum context length"),
    ("/completions", {"model": MODEL, "prompt": [5, 6], "max_tokens": 511}, 400, "max_tokens",
     "maximum context length"),
    ("/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
    ("/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "at least one"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content", "expected str or list[TextPart] (got 5)"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages",
     "role must be"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400,
     "tools", "not supported"),
    ("/nope", {}, 404, None, "no route"),
])
def test_bad_input_is_an_openai_error_body(server, path, body, status, param, needle):
    r = post(server[0], path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and needle in err["message"], err


def test_wrong_method_and_too_large_body(server):
    url = server[0]
    r = httpx.get(url + "/completions")
    assert r.status_code == 405 and r.json()["error"]["message"].startswith("no route")
    big = {"model": MODEL, "prompt": "x" * (2 << 20)}
    r = post(url, "/completions", big)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]


def test_the_openai_client_sees_the_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", n=3)
    assert e.value.body["param"] == "n"


# ------------------------------------------------------------------------------ slots, queue, keys, failures


@pytest.fixture(scope="module")
def one_slot(model_dir):
    """One sequence slot and room for one waiting request."""
    engine = Engine(model_dir, EngineConfig().replace(max_batch_seqs=1, max_batch_tokens=256,
                                                      prefill_chunk_tokens=64, max_seq_len_tokens=4096))
    with serving(engine, MODEL, max_waiting_requests=1) as (url, srv):
        yield url, srv


def test_a_cancelled_stream_frees_its_slot(one_slot):
    url, srv = one_slot
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
    before = metrics(url)
    stream = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4000, stream=True)
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()  # the client goes away mid-stream
    t = time.perf_counter()
    out = client.completions.create(model=MODEL, prompt=[8, 9], max_tokens=4)
    assert out.usage.completion_tokens == 4
    waited_s = time.perf_counter() - t
    after = metrics(url)
    generated = after[("moetune:generation_tokens_total", ())] - before[("moetune:generation_tokens_total", ())]
    # The first request's 4000 tokens were never made: its slot went to the second at once.
    assert generated < 1000, (generated, waited_s)
    aborted = (("finished_reason", "abort"),)
    assert after[("moetune:request_success_total", aborted)] - before.get(("moetune:request_success_total", aborted),
                                                                          0) == 1
    assert not srv.loop.engine.running and srv.loop.engine.free_slots == [0]


def test_a_full_queue_is_429_with_retry_after(one_slot):
    url, _ = one_slot
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
    running = client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=4000, stream=True)
    waiting = client.completions.create(model=MODEL, prompt=[5, 7], max_tokens=4000, stream=True)
    try:
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt=[5, 8], max_tokens=2)
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["type"] == "rate_limit_error"
    finally:
        running.close()
        waiting.close()
    deadline = time.monotonic() + 20
    while True:  # the two aborts reach the loop, then there is room again
        try:
            assert client.completions.create(model=MODEL, prompt=[5, 8], max_tokens=2).usage.completion_tokens == 2
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_non_streamed_request_whose_client_leaves_is_aborted(one_slot):
    url, srv = one_slot
    before = metrics(url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 4000}, timeout=0.5)
    deadline = time.monotonic() + 20
    aborted = ("moetune:request_success_total", (("finished_reason", "abort"),))
    while metrics(url).get(aborted, 0) == before.get(aborted, 0):
        assert time.monotonic() < deadline, "the abandoned request was not aborted"
        time.sleep(0.05)
    assert not srv.loop.engine.running


def test_api_key_on_every_route_but_health(model_dir, monkeypatch):
    engine = Engine(model_dir, EngineConfig().replace(**CONFIG))
    with serving(engine, MODEL, api_key="sekret") as (url, _):
        root = url.removesuffix("/v1")
        assert httpx.get(root + "/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/v1/nope"):
            r = httpx.get(root + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(root + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(root + "/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=url, api_key="sekret", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_the_loop_survives_a_failing_step(model_dir):
    engine = Engine(model_dir, EngineConfig().replace(**CONFIG))
    with serving(engine, MODEL) as (url, srv):
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
        real_step = engine.step
        calls = {"n": 0}
        lock = threading.Lock()

        def failing_step():  # fault injection: the third step raises, as a kernel error would
            with lock:
                calls["n"] += 1
                if calls["n"] == 3:
                    raise RuntimeError("injected failure")
            return real_step()

        engine.step = failing_step
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="doomed", max_tokens=20)
        assert "injected failure" in e.value.body["message"]
        assert client.completions.create(model=MODEL, prompt="fine", max_tokens=5).usage.completion_tokens == 5
        m = metrics(url)
        assert m[("moetune:engine_step_errors_total", ())] == 1 and srv.loop.alive
        assert not engine.running and sorted(engine.free_slots) == list(range(CONFIG["max_batch_seqs"]))


def test_end_of_sequence_and_a_model_without_a_tokenizer(make_ckpt, model_dir):
    probe = Engine(model_dir).generate([[5, 6, 7]], 12)[0]
    eos = probe[5]  # the same weights with the 6th greedy token as end of sequence: no maker tokenizer fits
    path = make_ckpt("qwen3_moe", eos_token_id=eos)
    assert not (path / "tokenizer.json").exists()
    with serving(Engine(path, EngineConfig().replace(**CONFIG)), MODEL) as (url, _):
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
        kw = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=12, extra_body={"ignore_eos": False,
                                                                            "return_token_ids": True})
        out = client.completions.create(**kw)
        assert out.choices[0].finish_reason == "stop" and out.choices[0].model_extra["token_ids"] == probe[:6]
        assert out.usage.completion_tokens == 6 and out.choices[0].text == ""  # ids only: no text to give
        chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
        assert len(chunks) == 6 and chunks[-1].choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError, match="no tokenizer.json"):
            client.completions.create(model=MODEL, prompt="text", max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert client.models.list().data[0].model_extra["moetune"]["tokenizer"] is False
