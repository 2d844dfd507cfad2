"""The parts under `engine serve`: per-request sampling and abort in the runtime, the maker's tokenizer
(and its upgrade of old cached built-in models), the sandboxed chat template, streaming text and stop
strings, request checks, and the `engine serve` command itself in a child process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from engine.config import ConfigError, EngineConfig
from engine.model.checkpoint import Checkpoint
from engine.model.maker import SPECIAL_TOKENS, make_model, resolve_model
from engine.runtime import Engine, SamplingParams
from engine.serve.protocol import ApiError, ChatRequest, CompletionRequest, parse_body
from engine.serve.text import Detokenizer, ModelText, StopMatcher, TextError


@pytest.fixture(scope="module")
def model_dir(make_ckpt):
    return make_ckpt("qwen3_moe")


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine(model_dir, EngineConfig().replace(max_batch_seqs=2, max_batch_tokens=64, prefill_chunk_tokens=16))


# ------------------------------------------------------------------------------ runtime


def run_all(engine):
    while engine.has_work:
        engine.step()


def test_abort_frees_the_slot_of_a_running_or_waiting_request(engine):
    a = engine.add("a", [5, 6, 7], 50)
    b = engine.add("b", [5, 6, 8], 50)
    c = engine.add("c", [5, 6, 9], 3)  # waits: two slots
    engine.step()
    assert {s.key for s in engine.running} == {"a", "b"} and engine.free_slots == []
    assert engine.abort("a") is a and a.finish_reason == "abort"
    assert engine.abort("a") is None  # already gone
    assert engine.free_slots == [a.slot]
    run_all_but = engine.abort("b")
    assert run_all_but is b
    run_all(engine)
    assert c.finish_reason == "length" and len(c.output) == 3
    assert sorted(engine.free_slots) == [0, 1]
    w = engine.add("w", [5], 3)
    assert engine.abort("w") is w and not engine.has_work


def test_per_request_sampling_leaves_other_requests_alone(model_dir):
    cfg = EngineConfig().replace(max_batch_seqs=4, max_batch_tokens=64)
    greedy = Engine(model_dir, cfg).generate([[5, 6, 7]], 12)[0]
    e = Engine(model_dir, cfg)
    seeded = [e.add(f"s{i}", [5, 6, 7], 12, SamplingParams(temperature=1.0, seed=11)) for i in range(2)]
    plain = e.add("p", [5, 6, 7], 12)
    other = e.add("o", [5, 6, 7], 12, SamplingParams(temperature=1.0, seed=12))
    run_all(e)
    assert plain.output == greedy  # greedy beside sampled requests in the same steps
    assert seeded[0].output == seeded[1].output != greedy  # a seed is the request's own stream
    assert other.output != seeded[0].output
    top1 = e.add("t", [5, 6, 7], 12, SamplingParams(temperature=1.0, top_k=1))
    run_all(e)
    assert top1.output == greedy


def test_per_request_ignore_eos(make_ckpt, model_dir):
    probe = Engine(model_dir).generate([[5, 6, 7]], 12)[0]
    eos = probe[5]  # a checkpoint whose end-of-sequence token is the 6th greedy token (same weights)
    e = Engine(make_ckpt("qwen3_moe", eos_token_id=eos), EngineConfig().replace(max_batch_seqs=2))
    assert e.generate([[5, 6, 7]], 12)[0] == probe
    stops = e.add("stops", [5, 6, 7], 12, SamplingParams(ignore_eos=False))
    keeps = e.add("keeps", [5, 6, 7], 12)  # the config's sampling.ignore_eos (true)
    run_all(e)
    assert stops.finish_reason == "eos" and stops.output == probe[: probe.index(eos) + 1]
    assert keeps.finish_reason == "length" and keeps.output == probe


# ------------------------------------------------------------------------------ tokenizer and template


def test_make_model_writes_a_tokenizer_covering_the_vocabulary(model_dir):
    text = ModelText(model_dir)
    assert text.vocab_size == Checkpoint(model_dir).spec.vocab_size
    assert [text.tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    for s in ("Hello, world!", "bako tefimo", "ü 你好 🙂", ""):
        ids = text.encode(s)
        assert ids[0] == 1 and text.decode(ids) == s  # BOS, then a lossless byte-level round trip
    assert all(isinstance(text.decode([i]), str) for i in range(text.vocab_size))


def test_old_cached_builtin_models_get_a_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETUNE_CACHE", str(tmp_path))
    path = resolve_model("builtin:olmoe-tiny")
    assert (path / "tokenizer.json").exists() and (path / "tokenizer_config.json").exists()
    before = Checkpoint(path).fingerprint()
    (path / "tokenizer.json").unlink()  # as made by a maker without tokenizers
    (path / "tokenizer_config.json").unlink()
    assert resolve_model("builtin:olmoe-tiny") == path
    assert (path / "tokenizer.json").exists() and Checkpoint(path).fingerprint() == before


def test_a_vocabulary_too_small_gets_no_tokenizer(tmp_path):
    make_model(tmp_path, "qwen3_moe", "tiny", dtype="float32", config_overrides={"vocab_size": 200})
    assert not (tmp_path / "tokenizer.json").exists()


def copy_with_template(model_dir: Path, dst: Path, template) -> Path:
    shutil.copytree(model_dir, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # reach Python's object graph
    "{{ messages.append({'role': 'x'}) }}",  # mutate what is passed in
    "{% for m in messages %}{{ m.__class__.__init__.__globals__ }}{% endfor %}",
])
def test_the_chat_template_runs_sandboxed(model_dir, tmp_path, template):
    text = ModelText(copy_with_template(model_dir, tmp_path / "m", template))
    with pytest.raises(TextError, match="sandbox forbids|template failed"):
        text.render_chat([{"role": "user", "content": "hi"}])


def test_a_template_that_does_not_compile_is_one_line(model_dir, tmp_path):
    with pytest.raises(TextError, match="tokenizer_config.json: field 'chat_template' does not compile"):
        ModelText(copy_with_template(model_dir, tmp_path / "m", "{% for %}"))


def test_detokenizer_holds_incomplete_characters(model_dir):
    text = ModelText(model_dir)
    s = "a 你好 🙂 b"
    ids = text.encode(s, add_special_tokens=False)
    det = Detokenizer(text)
    pieces = [det.push(t) for t in ids]
    assert "".join(pieces) + det.flush() == s
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize(("chunks", "stops", "sent", "stopped"), [
    (["hel", "lo wor", "ld"], ["lo w"], "hel", True),
    (["abc", "def"], ["xyz"], "abcdef", False),
    (["ab", "c"], ["bcd"], "a", False),  # "bc" held back: it may start "bcd"
    (["one STO", "P two"], ["STOP", "ne"], "o", True),  # the earliest stop wins
])
def test_stop_matcher(chunks, stops, sent, stopped):
    m = StopMatcher(stops)
    out, hit = "", False
    for c in chunks:
        r = m.feed(c)
        out += r.text
        if r.stopped:
            hit = True
            break
    assert out == sent and hit == stopped
    if not stopped:
        assert out + m.flush() == "".join(chunks)


# ------------------------------------------------------------------------------ request checks


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"model": "m", "prompt": "x", "stop": [1]}, "stop"),
    ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "m", "prompt": "x", "seed": -1}, "seed"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "presence_penalty": 1.0}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"model": 5, "prompt": "x"}, "model"),
])
def test_completion_fields(body, param):
    with pytest.raises(ApiError) as e:
        parse_body(json.dumps(body).encode(), CompletionRequest)
    assert e.value.status == 400 and e.value.param == param


def test_chat_fields():
    ok = parse_body(json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_completion_tokens": 3}).encode(),
        ChatRequest)
    assert ok.messages[0].text() == "ab" and ok.token_limit == 3
    with pytest.raises(ApiError) as e:
        parse_body(json.dumps({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {}}]}]}).encode(), ChatRequest)
    assert e.value.param.startswith("messages.0.content")


# ------------------------------------------------------------------------------ the command


def start(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", *args, "--port", "0", "--log-level",
                             "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    assert "http://" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, line


def test_engine_serve_command(model_dir, tmp_path):
    """The CLI: a tuner export as --config (hash logged, warnings for another model and machine),
    MOETUNE_API_KEY, 127.0.0.1 by default."""
    cfg = EngineConfig().replace(max_batch_seqs=3)
    export = {"engine_config": cfg.to_dict(), "model": {"fingerprint": "not-this-model", "path": "/elsewhere"},
              "hardware": {"fingerprint": "not-this-machine", "cpu_model": "Some Other CPU"}}
    path = tmp_path / "best.json"
    path.write_text(json.dumps(export))
    env = {**os.environ, "MOETUNE_API_KEY": "k3y", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc, line = start(["--model", str(model_dir), "--config", str(path), "--threads", "1"], env)
    try:
        assert f"with config {cfg.replace(threads=1).config_hash()} from {path}" in line
        url = line[line.index("http://"):].split()[0]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        root = url.removesuffix("/v1")
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(root + "/health", timeout=5) as r:
                    assert r.status == 200
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/models", timeout=5)
        assert e.value.code == 401
        req = urllib.request.Request(url + "/models", headers={"Authorization": "Bearer k3y"})
        with urllib.request.urlopen(req, timeout=5) as r:
            card = json.loads(r.read())["data"][0]
        assert card["id"] == str(model_dir) and card["moetune"]["max_batch_seqs"] == 3
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "was tuned for another model (/elsewhere)" in err and "was tuned on other hardware (Some Other CPU)" in err


@pytest.mark.parametrize(("args", "needle"), [
    (["--port", "70000"], "serve.port='70000': above the maximum 65535"),
    (["--max-body-bytes", "x"], "serve.max_body_bytes='x': must be int"),
    (["--model", "/nonexistent/m"], "/nonexistent/m"),
])
def test_engine_serve_bad_flags_are_one_line(args, needle, capsys):
    from engine.cli import main

    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("engine: error: ") and needle in err and "\n" not in err


def test_serve_settings_come_from_one_declaration():
    from engine.serve.config import ServeConfig, serve_knobs

    assert {k.name for k in serve_knobs()} == set(ServeConfig.__dataclass_fields__)
    assert all(k.doc for k in serve_knobs()) and ServeConfig().host == "127.0.0.1"
    with pytest.raises(ConfigError):
        serve_knobs()[1].check(-1, "x")


def test_bench_serve_command_runs_both_ways(model_dir, capsys):
    """The HTTP-overhead benchmark end to end on a tiny run (it asserts no timing: that is its output)."""
    from engine.cli import main

    assert main(["bench-serve", "--model", str(model_dir), "--workload", "builtin:tiny", "--mode", "offline",
                 "--max-requests", "3", "--repeats", "1", "--warmup-rounds", "1", "--threads", "1", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    res = json.loads(out[-1])
    assert [r["how"] for r in res["rows"]] == ["served", "inprocess"]  # the warm-up round is not counted
    assert res["warmup_rounds"] == 1 and [r["round"] for r in res["rows"]] == [0, 0]
    lo, hi, method = res["tpot_p50_overhead_pct_interval"]
    assert lo <= res["tpot_p50_overhead_pct"] <= hi and method == "single"
    assert res["ttft_p50_overhead_ms_interval"][2] == "min-max"
    assert res["same_requests_and_tokens"] is True and res["rows"][0]["output_tokens"] > 0
    assert res["tpot_p50_overhead_pct"] is not None and res["ttft_p50_overhead_ms"] is not None
    assert any(line.startswith("HTTP overhead") for line in out)


def test_bench_serve_intervals_widen_with_the_round_to_round_spread():
    """The TTFT difference's interval: min-max of pairs under 5 rounds, a seeded bootstrap from 5."""
    from engine.serve.bench import _diff_interval

    assert _diff_interval([10.0, 12.0], [9.0, 10.0]) == [0.0, 3.0, "min-max"]
    tight = _diff_interval([10.0, 10.1, 10.2, 9.9, 10.0], [9.0, 9.1, 9.0, 8.9, 9.0])
    wide = _diff_interval([10.0, 14.0, 6.0, 12.0, 8.0], [9.0, 13.0, 5.0, 11.0, 7.0])
    assert tight[2] == wide[2] == "bootstrap 95%" and tight[0] > 0.5
    assert wide[0] < 0 < wide[1] and wide[1] - wide[0] > tight[1] - tight[0]
    assert _diff_interval([None], [1.0]) is None
