"""The ``workloads`` command end to end: import -> show round trips, JSON output, one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from workloads.cli import main
from workloads.router import RouterTrace
from workloads.schema import load_workload


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def _show_json(capsys, spec: str) -> dict:
    status, out, _ = _run(capsys, "show", spec, "--json")
    assert status == 0
    return json.loads(out.strip().splitlines()[-1])


def test_import_show_round_trip_vidur(tmp_path: Path, capsys):
    src = tmp_path / "v.csv"
    rows = [(0.25 * i, 100 + 10 * i, 20 + i) for i in range(9)]
    src.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                   + "".join(f"{a},{p},{o}\n" for a, p, o in rows))
    status, out, _ = _run(capsys, "import", "--format", "vidur", str(src), "--out", str(tmp_path / "w"))
    assert status == 0 and "9 requests over 2.00 s" in out
    stats = _show_json(capsys, str(tmp_path / "w"))
    assert stats["n_requests"] == 9 and stats["duration_s"] == 2.0 and stats["rate_per_s"] == 4.0
    assert stats["burstiness_cv"] == 0.0
    assert stats["prompt_len"]["p50"] == 140 and stats["prompt_len"]["mean"] == 140
    assert stats["output_len"]["min"] == 20 and stats["output_len"]["max"] == 28
    assert stats["total_prompt_tokens"] == sum(p for _, p, _ in rows)
    meta = load_workload(tmp_path / "w").metadata
    assert meta["command"].startswith("workloads import --format vidur")


def test_import_burstgpt_reports_drops(tmp_path: Path, capsys):
    src = tmp_path / "b.csv"
    src.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                   "0,ChatGPT,10,5,15,Conversation log\n1,ChatGPT,10,0,10,Conversation log\n"
                   "3,GPT-4,30,7,37,API log\n")
    status, out, _ = _run(capsys, "import", "--format", "burstgpt", str(src), "--out", str(tmp_path / "w"))
    assert status == 0 and "dropped 1 rows: failed" in out
    stats = _show_json(capsys, str(tmp_path / "w"))
    assert stats["n_requests"] == 2 and stats["rate_per_s"] == pytest.approx(1 / 3, rel=1e-5)
    assert stats["tags"] == {"ChatGPT/Conversation log": 1, "GPT-4/API log": 1}


def test_import_bad_row_is_one_line_exit_2(tmp_path: Path, capsys):
    src = tmp_path / "trace.csv"
    src.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,3\n"
                   "2023-11-16 18:15:47.68,abc,3\n")
    status, out, err = _run(capsys, "import", "--format", "azure", str(src), "--out", str(tmp_path / "w"))
    assert status == 2 and out == ""
    assert err == f"workloads: error: {src}: row 2 (line 3): field 'ContextTokens': 'abc' is not an integer\n"
    assert not (tmp_path / "w").exists()


def test_usage_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["import", "--format", "nope", "x", "--out", "y"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err


def test_show_missing_workload(tmp_path: Path, capsys):
    status, _, err = _run(capsys, "show", str(tmp_path / "nope"))
    assert status == 2 and err.startswith("workloads: error: ") and err.count("\n") == 1


def test_synth_transform_show(tmp_path: Path, capsys):
    out_dir = tmp_path / "s"
    argv = ["synth", "--out", str(out_dir), "--n-requests", "40", "--arrival", "gamma", "--cv", "2", "--rate", "4",
            "--prompt-len", "uniform:10:20", "--output-len", "5", "--seed", "9", "--n-layers", "2",
            "--n-experts", "8", "--top-k", "2"]
    assert _run(capsys, *argv)[0] == 0
    first = (out_dir / "requests.jsonl").read_text()
    assert _run(capsys, *argv)[0] == 0
    assert (out_dir / "requests.jsonl").read_text() == first  # same seed, same file
    stats = _show_json(capsys, str(out_dir))
    assert stats["n_requests"] == 40 and stats["output_len"]["max"] == 5
    assert len(stats["router"]["top10_share"]) == 2 and stats["router"]["n_tokens"] == stats["total_prompt_tokens"] + 40 * 4
    status, _, _ = _run(capsys, "transform", str(out_dir), "--sample", "10", "--rate-scale", "2",
                        "--max-prompt-len", "15", "--out", str(tmp_path / "t"))
    assert status == 0
    small = load_workload(tmp_path / "t")
    assert len(small) == 10 and small.prompt_lens.max() <= 15
    assert set(small.router_trace.request_ids) <= {r.request_id for r in small}
    assert small.metadata["history"][0].startswith("workloads synth")
    status, _, err = _run(capsys, "transform", str(out_dir), "--out", str(tmp_path / "t2"))
    assert status == 2 and "nothing to do" in err
    status, _, err = _run(capsys, "synth", "--out", str(tmp_path / "x"), "--n-layers", "2")
    assert status == 2 and "--n-experts" in err


def test_list_builtin(capsys):
    status, out, _ = _run(capsys, "list-builtin", "--json")
    rows = json.loads(out.strip().splitlines()[-1])
    assert status == 0 and {"builtin:chat", "builtin:tiny"} <= {r["name"] for r in rows}


def test_record_uses_engine(tmp_path: Path, capsys, monkeypatch):
    calls = {}

    def record_router_trace(model, workload, config=None):
        calls["model"], calls["n"] = model, len(workload)
        identity = {"arch": "fake", "n_layers": 1, "moe_layers": [0], "n_experts": 4, "top_k": 1,
                    "hidden_size": 8, "fingerprint": "f" * 16}
        per_request = {r.request_id: (np.zeros((r.prompt_len, 1, 1)), np.ones((r.prompt_len, 1, 1)))
                       for r in workload.requests}
        return RouterTrace.from_requests(identity, per_request)

    fake = types.ModuleType("engine.runner")
    fake.record_router_trace = record_router_trace
    monkeypatch.setitem(sys.modules, "engine.runner", fake)
    status, out, _ = _run(capsys, "record", "--model", "m", "--workload", "builtin:tiny", "--out",
                          str(tmp_path / "r"), "--max-requests", "3")
    assert status == 0 and calls == {"model": "m", "n": 3}
    w = load_workload(tmp_path / "r")
    assert len(w) == 3 and w.router_trace is not None and w.router_trace.model_identity["arch"] == "fake"
    assert w.metadata["router_trace"]["model"] == "m"


def test_console_script_show_json():
    assert shutil.which("workloads"), "the `workloads` console script is not installed (pip install -e .)"
    proc = subprocess.run(["workloads", "show", "builtin:tiny", "--json"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["n_requests"] == 12 and stats["name"] == "tiny"
