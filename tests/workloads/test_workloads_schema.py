"""Request / Workload schema, the on-disk format and its validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workloads.schema import (
    BLOCK_TOKENS,
    Request,
    Workload,
    WorkloadError,
    builtin_names,
    load_workload,
    save_workload,
)


def _workload() -> Workload:
    requests = [Request("b", 1.5, 10, 4, tag="x"), Request("a", 0.0, 3, 2, prompt_ids=(5, 6, 7)),
                Request("c", 3.0, 600, 8, hash_ids=(11, 12))]
    return Workload("demo", requests, {"source": "test", "seed": 1})


def test_sorted_by_arrival_and_properties():
    w = _workload()
    assert [r.request_id for r in w] == ["a", "b", "c"]
    assert w.duration_s == 3.0
    assert w.rate_per_s == pytest.approx(2 / 3)
    assert w.total_prompt_tokens == 613 and w.total_output_tokens == 14
    assert Workload("one", [Request("a", 0.0, 1, 1)]).rate_per_s is None


def test_save_load_round_trip(tmp_path: Path):
    w = _workload()
    save_workload(w, tmp_path / "w")
    back = load_workload(tmp_path / "w")
    assert back.requests == w.requests
    assert back.metadata == w.metadata and back.name == "demo"
    assert load_workload(str(tmp_path / "w" / "workload.json")).requests == w.requests


def test_bare_jsonl(tmp_path: Path):
    path = tmp_path / "reqs.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_len": 4, "max_new_tokens": 2}\n\n'
                    '{"arrival_s": 0.5, "prompt_ids": [1, 2, 3], "max_new_tokens": 1, "tag": "t"}\n')
    w = load_workload(path)
    assert [r.request_id for r in w] == ["0", "1"]
    assert w.requests[1].prompt_len == 3 and w.requests[1].prompt_ids == (1, 2, 3)
    save_workload(w, tmp_path / "out.jsonl")
    assert load_workload(tmp_path / "out.jsonl").requests == w.requests


def _write_dir(tmp_path: Path, lines: list[str], **header) -> Path:
    d = tmp_path / "bad"
    d.mkdir(exist_ok=True)
    head = {"format": "moetune-workload", "format_version": 1, "name": "bad", "n_requests": len(lines),
            "router_trace": None, "metadata": {}}
    head.update(header)
    (d / "workload.json").write_text(json.dumps(head, indent=2))
    (d / "requests.jsonl").write_text("".join(line + "\n" for line in lines))
    return d


GOOD = '{"request_id": "r0", "arrival_s": 0, "prompt_len": 4, "max_new_tokens": 2}'


@pytest.mark.parametrize(("line", "expected"), [
    ('{"request_id": "r1", "arrival_s": 1, "prompt_len": 4}', "line 2: field 'max_new_tokens': missing"),
    ('{"request_id": "r1", "arrival_s": 1, "prompt_len": "abc", "max_new_tokens": 2}',
     "line 2: field 'prompt_len': 'abc' is not an integer"),
    ('{"request_id": "r1", "arrival_s": -1, "prompt_len": 4, "max_new_tokens": 2}', "line 2: field 'arrival_s'"),
    ('{"request_id": "r1", "arrival_s": 1, "prompt_len": 4, "max_new_tokens": 0}',
     "line 2: field 'max_new_tokens': 0 is less than 1"),
    ('{"request_id": "r1", "arrival_s": 1, "promt_len": 4, "max_new_tokens": 2}', "line 2: field 'promt_len': unknown"),
    ('{"request_id": "r0", "arrival_s": 1, "prompt_len": 4, "max_new_tokens": 2}', "line 2: field 'request_id'"),
    ('{"request_id": "r1", "arrival_s": 1, "prompt_len": 2, "prompt_ids": [1], "max_new_tokens": 2}',
     "line 2: field 'prompt_ids'"),
    ('{"request_id": "r1", "arrival_s": 1, "prompt_len": 2, "max_new_tokens": true}',
     "line 2: field 'max_new_tokens'"),
    ('{"request_id": "r1", "arrival_s": 1, "prompt_len": 4, "max_new_tokens": 2', "line 2: not valid JSON"),
])
def test_bad_request_lines(tmp_path: Path, line: str, expected: str):
    d = _write_dir(tmp_path, [GOOD, line])
    with pytest.raises(WorkloadError) as info:
        load_workload(d)
    message = str(info.value)
    assert message.startswith(str(d / "requests.jsonl") + ": ")
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize(("header", "expected"), [
    ({"format_version": 2}, "line 3: field 'format_version': version 2 is not supported"),
    ({"format_version": "1"}, "field 'format_version': '1' is not an integer"),
    ({"format": "other"}, "line 2: field 'format'"),
    ({"n_requests": 5}, "field 'n_requests': says 5"),
    ({"extra": 1}, "field 'extra': unknown field"),
])
def test_bad_header(tmp_path: Path, header: dict, expected: str):
    d = _write_dir(tmp_path, [GOOD], **header)
    with pytest.raises(WorkloadError, match="workload.json: ") as info:
        load_workload(d)
    assert expected in str(info.value)


def test_missing_workload(tmp_path: Path):
    with pytest.raises(WorkloadError, match="no such workload"):
        load_workload(tmp_path / "nope")
    with pytest.raises(WorkloadError, match="no such built-in workload"):
        load_workload("builtin:nope")


def test_refuses_to_overwrite_foreign_directory(tmp_path: Path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "precious.txt").write_text("x")
    with pytest.raises(WorkloadError, match="refusing"):
        save_workload(_workload(), tmp_path / "other")


def test_builtins_load_and_are_small():
    names = builtin_names()
    assert {"chat", "bursty", "offline", "long-prompt", "tiny"} <= set(names)
    for name in names:
        w = load_workload(f"builtin:{name}")
        assert len(w) > 0 and w.router_trace is None
        size = sum(p.stat().st_size for p in (Path(__file__).parents[2] / "workloads" / "builtin" / name).iterdir())
        assert size < 200_000
    tiny = load_workload("builtin:tiny")
    assert len(tiny) == 12 and tiny.prompt_lens.max() <= 48 and tiny.output_lens.max() <= 16
    assert load_workload("builtin:offline").duration_s == 0.0
    assert load_workload("builtin:long-prompt").prompt_lens.min() >= 1024


def test_prompt_token_ids_deterministic():
    r = Request("r1", 0.0, 100, 4)
    ids = r.prompt_token_ids(1000, seed=3)
    assert len(ids) == 100 and min(ids) >= 0 and max(ids) < 1000
    assert ids == Request("r1", 5.0, 100, 9).prompt_token_ids(1000, seed=3)
    assert ids != Request("r2", 0.0, 100, 4).prompt_token_ids(1000, seed=3)
    assert ids != r.prompt_token_ids(1000, seed=4)


def test_prompt_token_ids_prefix_sharing():
    a = Request("a", 0.0, 2 * BLOCK_TOKENS + 100, 4, hash_ids=(7, 8, 9))
    b = Request("b", 1.0, BLOCK_TOKENS + 40, 4, hash_ids=(7, 8))
    c = Request("c", 1.0, 3 * BLOCK_TOKENS, 4, hash_ids=(7, 99, 9))
    ids_a, ids_b, ids_c = (r.prompt_token_ids(32000) for r in (a, b, c))
    assert len(ids_a) == a.prompt_len and len(ids_b) == b.prompt_len
    assert ids_a[:len(ids_b)] == ids_b  # shared blocks, the partial last block is a prefix of the full one
    assert ids_a[:BLOCK_TOKENS] == ids_c[:BLOCK_TOKENS]
    assert ids_a[BLOCK_TOKENS:2 * BLOCK_TOKENS] != ids_c[BLOCK_TOKENS:2 * BLOCK_TOKENS]


def test_prompt_ids_checked_against_vocab():
    r = Request("big", 0.0, 2, 1, prompt_ids=(1, 500))
    assert r.prompt_token_ids(501) == [1, 500]
    with pytest.raises(WorkloadError, match="request 'big'.*500"):
        r.prompt_token_ids(100)
