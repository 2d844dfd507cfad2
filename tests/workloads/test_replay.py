"""`workloads replay` against a real `engine serve` (uvicorn on 127.0.0.1): the same requests and token
counts as `engine run` on the same workload and config, prompts as token ids or as text of the
recorded length, results in the results database."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from sqlalchemy import select

from db.models import RequestRow, Study, Trial
from db.session import make_engine, session_scope
from engine.config import EngineConfig
from engine.model.maker import make_model
from engine.runner import run_workload
from engine.runtime import Engine
from engine.serve.testing import serving
from workloads.cli import main
from workloads.replay import ReplayOptions, _takes_token_ids, fetch_server_info, replay
from workloads.schema import load_workload

CONFIG = dict(max_batch_seqs=16, max_batch_tokens=512, prefill_chunk_tokens=128, max_seq_len_tokens=1024)
RATE_SCALE = 30.0  # builtin:chat's minute of arrivals in two seconds


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay-model")
    make_model(d, "qwen3_moe", "tiny", seed=5, dtype="float32")
    return d


@pytest.fixture(scope="module")
def server(model_dir):
    with serving(Engine(model_dir, EngineConfig().replace(**CONFIG)), "tiny") as (url, srv):
        yield url, srv


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_replay_of_builtin_chat_matches_engine_run(server, model_dir):
    url, srv = server
    workload = load_workload("builtin:chat")
    served = replay(url, workload, options=ReplayOptions(rate_scale=RATE_SCALE))
    inproc = run_workload(Engine(model_dir, EngineConfig().replace(**CONFIG)), workload, rate_scale=RATE_SCALE)
    assert [r.request_id for r in served.requests] == [r.request_id for r in inproc.requests]
    assert [(r.prompt_tokens, r.output_tokens) for r in served.requests] == \
        [(r.prompt_tokens, r.output_tokens) for r in inproc.requests]
    assert all(r.finish_reason == "length" for r in served.requests)
    s, i = served.summary(), inproc.summary()
    for key in ("requests", "requests_done", "prompt_tokens", "output_tokens"):
        assert s[key] == i[key], key
    for r in served.requests:  # the same definitions as engine run
        assert r.ttft_ms > 0 and r.e2e_ms >= r.ttft_ms and len(r.itl_ms) == r.output_tokens - 1
        assert r.arrival_s == pytest.approx(next(w.arrival_s for w in workload.requests
                                                 if w.request_id == r.request_id) / RATE_SCALE)
    m = served.meta
    assert m["backend"] == "http" and m["prompts"]["format"] == "ids"
    assert m["server"]["models"] == httpx.get(url + "/models").json()
    assert m["config_hash"] == srv.loop.info.config_hash and m["model"]["fingerprint"]
    assert not m["errors"] and not m["prompt_length_mismatch"] and not m["output_length_mismatch"]
    assert s["ttft_ms_p50"] is not None and s["tpot_ms_p99"] is not None


def test_text_prompts_and_the_database(server, model_dir, tmp_path, capsys):
    url, _ = server
    db = f"sqlite:///{tmp_path / 'r.db'}"
    args = ["replay", "--url", url, "--workload", "builtin:tiny", "--rate-scale", "10", "--prompts", "text",
            "--tokenizer", str(model_dir), "--db", db, "--slo", "ttft_p99_ms=60000", "--json"]
    assert main(args) == 0
    res = last_json(capsys)
    assert res["meta"]["prompts"]["format"] == "text" and not res["meta"]["prompt_length_mismatch"]
    wl = load_workload("builtin:tiny")
    assert [r["prompt_tokens"] for r in res["requests"]] == [r.prompt_len for r in wl.requests]
    assert main(args) == 0  # a second replay: a second trial of the same study
    capsys.readouterr()
    engine = make_engine(db)
    with session_scope(engine) as s:
        study = s.scalars(select(Study)).one()
        assert study.name == "http-tiny-tiny" and study.backend == "http"
        trials = s.scalars(select(Trial).order_by(Trial.number)).all()
        assert [t.number for t in trials] == [0, 1] and {t.state for t in trials} == {"complete"}
        assert trials[0].meta["backend"] == "http" and trials[0].meta["server"]["model"] == "tiny"
        assert trials[0].slo_attainment == 1.0 and trials[0].ttft_p50_ms is not None
        assert len(s.scalars(select(RequestRow).where(RequestRow.trial_id == trials[0].id)).all()) == len(wl)
    engine.dispose()


def test_the_token_id_probe(server):
    url, _ = server

    async def probe(model):
        async with httpx.AsyncClient() as c:
            info = await fetch_server_info(c, url, None, None)
            info.model = model
            return await _takes_token_ids(c, info, None, 512)

    assert asyncio.run(probe("tiny")) == (True, "accepted")
    ok, why = asyncio.run(probe("not-served"))
    assert not ok and why.startswith("HTTP 404")


@pytest.mark.parametrize(("extra", "needle"), [
    (["--url", "localhost:8000"], "expected http://HOST:PORT/v1"),
    (["--url", "http://127.0.0.1:9/v1"], "cannot reach the server"),
    (["--model", "other"], "the server serves tiny"),
    (["--prompts", "text"], "--prompts text: give --tokenizer DIR"),
    (["--workload", "builtin:nope"], "nope"),
])
def test_bad_input_is_one_line(server, extra, needle, capsys):
    args = {"--url": server[0], "--workload": "builtin:tiny"}
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        args[flag] = value
    assert main(["replay", *[x for kv in args.items() for x in kv]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("workloads: error: ") and needle in err and "\n" not in err
