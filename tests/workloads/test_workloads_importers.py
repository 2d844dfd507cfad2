"""Each importer on a small file written here, including a malformed row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workloads.importers import ImportOptions, import_trace
from workloads.schema import WorkloadError


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


AZURE_2023 = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:47.6805900,879,20
"""
AZURE_2024 = """TIMESTAMP,ContextTokens,GeneratedTokens
2024-05-10 00:00:00.009930+00:00,2162,5
2024-05-10 00:00:00.309930+00:00,1000,0
2024-05-10 00:00:01.009930+00:00,7,12
"""


def test_azure_2023(tmp_path: Path):
    w = import_trace("azure", _write(tmp_path, "az.csv", AZURE_2023))
    assert len(w) == 3
    assert [r.arrival_s for r in w] == pytest.approx([0.0, 1.0, 4.314579])
    assert [r.prompt_len for r in w] == [374, 879, 396] and [r.max_new_tokens for r in w] == [44, 20, 109]
    assert w.metadata["format"] == "azure" and w.metadata["origin"].startswith("Azure")
    assert len(w.metadata["source_sha256"]) == 64


def test_azure_2024_timezone_and_zero_output(tmp_path: Path):
    w = import_trace("azure", _write(tmp_path, "az.csv", AZURE_2024))
    assert [r.arrival_s for r in w] == pytest.approx([0.0, 1.0])
    assert w.metadata["dropped"] == {"zero_output": 1}


def test_azure_bad_row(tmp_path: Path):
    text = AZURE_2023 + "2023-11-16 18:15:52.0,abc,10\n"
    path = _write(tmp_path, "trace.csv", text)
    with pytest.raises(WorkloadError) as info:
        import_trace("azure", path)
    assert str(info.value) == f"{path}: row 4 (line 5): field 'ContextTokens': 'abc' is not an integer"
    path = _write(tmp_path, "trace.csv", AZURE_2023 + "yesterday,3,10\n")
    with pytest.raises(WorkloadError, match=r"row 4 \(line 5\): field 'TIMESTAMP': 'yesterday' is not a datetime"):
        import_trace("azure", path)


def test_missing_column(tmp_path: Path):
    path = _write(tmp_path, "t.csv", "TIMESTAMP,Context\n2023-11-16 18:15:46,3\n")
    with pytest.raises(WorkloadError, match=r"t.csv: line 1: field 'ContextTokens': missing column"):
        import_trace("azure", path)


BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
7,ChatGPT,1087,0,1087,Conversation log
9.5,GPT-4,22,314,336,API log
"""


def test_burstgpt_drops_failed(tmp_path: Path):
    w = import_trace("burstgpt", _write(tmp_path, "b.csv", BURSTGPT))
    assert len(w) == 2 and w.metadata["dropped"] == {"failed": 1}
    assert [r.arrival_s for r in w] == [0.0, 4.5]
    assert [r.tag for r in w] == ["ChatGPT/Conversation log", "GPT-4/API log"]


def test_burstgpt_keep_failed(tmp_path: Path):
    w = import_trace("burstgpt", _write(tmp_path, "b.csv", BURSTGPT), ImportOptions(keep_failed=True))
    assert len(w) == 3 and w.requests[1].max_new_tokens == 1
    assert w.requests[1].tag == "ChatGPT/Conversation log/failed"


def test_burstgpt_bad_row(tmp_path: Path):
    path = _write(tmp_path, "b.csv", BURSTGPT + "11,GPT-4,22,-3,19,API log\n")
    with pytest.raises(WorkloadError, match=r"row 4 \(line 5\): field 'Response tokens': -3 is negative"):
        import_trace("burstgpt", path)
    path = _write(tmp_path, "b.csv", BURSTGPT + "11,GPT-4\n")
    with pytest.raises(WorkloadError, match=r"row 4 \(line 5\): field 'Request tokens'"):
        import_trace("burstgpt", path)


MOONCAKE = "\n".join(json.dumps(row) for row in [
    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": list(range(14))},
    {"timestamp": 30535, "input_length": 6472, "output_length": 26, "hash_ids": [*range(12), 46, 47]},
    {"timestamp": 35000, "input_length": 100, "output_length": 10},
]) + "\n"


def test_mooncake(tmp_path: Path):
    w = import_trace("mooncake", _write(tmp_path, "m.jsonl", MOONCAKE))
    assert [r.arrival_s for r in w] == pytest.approx([0.0, 3.053, 7.518])
    assert w.requests[0].hash_ids == tuple(range(14)) and w.requests[2].hash_ids is None
    assert [r.prompt_len for r in w] == [6955, 6472, 100]
    a, b = (r.prompt_token_ids(32000) for r in w.requests[:2])
    assert a[:12 * 512] == b[:12 * 512] and a[12 * 512:12 * 512 + 10] != b[12 * 512:12 * 512 + 10]


def test_mooncake_clip_keeps_hash_prefix(tmp_path: Path):
    w = import_trace("mooncake", _write(tmp_path, "m.jsonl", MOONCAKE), ImportOptions(max_prompt_len=1000))
    assert w.requests[0].prompt_len == 1000 and w.requests[0].hash_ids == (0, 1)
    assert w.metadata["clipped"] == {"prompt": 2}


def test_mooncake_bad_line(tmp_path: Path):
    path = _write(tmp_path, "m.jsonl", MOONCAKE + '{"timestamp": 1, "input_length": "x", "output_length": 3}\n')
    with pytest.raises(WorkloadError) as info:
        import_trace("mooncake", path)
    assert str(info.value) == f"{path}: line 4: field 'input_length': 'x' is not an integer >= 0"
    path = _write(tmp_path, "m.jsonl", MOONCAKE + '{"timestamp": 1, "input_length": 3}\n')
    with pytest.raises(WorkloadError, match="line 4: field 'output_length': missing"):
        import_trace("mooncake", path)


VIDUR = """arrived_at,num_prefill_tokens,num_decode_tokens,extra
0.0,120,30,a
0.5,300,12,b
1.0,80,60,c
1.5,7,9,d
"""


def test_vidur_and_limit(tmp_path: Path):
    path = _write(tmp_path, "v.csv", VIDUR)
    w = import_trace("vidur", path)
    assert len(w) == 4 and w.rate_per_s == pytest.approx(2.0)
    w = import_trace("vidur", path, ImportOptions(limit=2, max_output_len=20))
    assert len(w) == 2 and [r.max_new_tokens for r in w] == [20, 12]


def test_vidur_bad_row(tmp_path: Path):
    path = _write(tmp_path, "v.csv", VIDUR + "soon,1,1,e\n")
    with pytest.raises(WorkloadError, match=r"row 5 \(line 6\): field 'arrived_at': 'soon' is not a number"):
        import_trace("vidur", path)


SHAREGPT = [
    {"id": "a1", "conversations": [{"from": "human", "value": "hello there how are you"},
                                   {"from": "gpt", "value": "fine thanks and you"}]},
    {"id": "a2", "conversations": [{"from": "gpt", "value": "orphan reply"}]},
    {"id": "a3", "conversations": [{"from": "system", "value": "be nice"},
                                   {"from": "human", "value": "x" * 400},
                                   {"from": "gpt", "value": "y" * 40}, {"from": "human", "value": "more"}]},
]


def test_sharegpt_estimated_lengths(tmp_path: Path):
    path = _write(tmp_path, "s.json", json.dumps(SHAREGPT))
    w = import_trace("sharegpt", path, ImportOptions(rate_per_s=2.0, seed=3))
    assert len(w) == 2 and w.metadata["dropped"] == {"no_reply": 1}
    assert [r.request_id for r in w] == ["sharegpt-a1", "sharegpt-a3"]
    assert [r.prompt_len for r in w] == [6, 100] and [r.max_new_tokens for r in w] == [5, 10]
    assert "characters / 4" in w.metadata["lengths"]
    assert w.requests[0].arrival_s == 0.0 and w.requests[1].arrival_s > 0
    again = import_trace("sharegpt", path, ImportOptions(rate_per_s=2.0, seed=3))
    assert again.requests == w.requests


def test_sharegpt_tokenizer(tmp_path: Path):
    import tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "there": 2, "how": 3, "are": 4, "you": 5, "fine": 6, "thanks": 7, "and": 8}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    path = _write(tmp_path, "s.json", json.dumps(SHAREGPT[:1]))
    w = import_trace("sharegpt", path, ImportOptions(tokenizer_dir=str(tmp_path / "tok")))
    r = w.requests[0]
    assert r.prompt_ids == (1, 2, 3, 4, 5) and r.prompt_len == 5 and r.max_new_tokens == 4
    assert "tokenized" in w.metadata["lengths"]


def test_sharegpt_bad_entry(tmp_path: Path):
    path = _write(tmp_path, "s.json", json.dumps([*SHAREGPT, {"id": "b", "conversations": "oops"}]))
    with pytest.raises(WorkloadError, match="s.json: entry 4: field 'conversations': missing or not a list"):
        import_trace("sharegpt", path)
    with pytest.raises(WorkloadError, match="tokenizer.json: no such file"):
        import_trace("sharegpt", path, ImportOptions(tokenizer_dir=str(tmp_path)))
