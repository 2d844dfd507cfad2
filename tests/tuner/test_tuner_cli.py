"""Bad input to ``tuner`` is one line on stderr and exit status 2, before any model work."""

from __future__ import annotations

import json

import pytest

from db.session import upgrade
from tuner.cli import main


@pytest.fixture
def bad_config(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"scheduler": {"max_batch_seqz": 8}}))
    return str(path)


CASES = [
    (["run", "--slo", "ttft_p99=2000"], ["--slo 'ttft_p99=2000'", "unknown SLO metric"]),
    (["run", "--slo", "ttft_p99_ms=soon"], ["'soon'", "not a number"]),
    (["run", "--slo", "quality_min=2"], ["quality_min", "between 0 and 1"]),
    (["run", "--db", "no-such-scheme"], ["not a database URL"]),
    (["run", "--db", "mysql://u@localhost/x"], ["mysql"]),
    (["run", "--db", "sqlite:////no/such/dir/moetune.db"], ["/no/such/dir", "does not exist"]),
    (["run", "--db", "postgresql://u:secret@127.0.0.1:1/x"], ["cannot open database", "***"]),
    (["run", "--fix", "max_batch_seqz=8"], ["unknown knob 'max_batch_seqz'"]),
    (["run", "--fix", "max_batch_seqs=0"], ["scheduler.max_batch_seqs=0", "minimum"]),
    (["run", "--config", "BAD_CONFIG"], ["unknown key 'scheduler.max_batch_seqz'"]),
    (["run", "--config", "/no/such/config.json"], ["no such config file"]),
    (["run", "--objectives", "speed,tpot_p99_ms"], ["unknown objective 'speed'"]),
    (["run", "--objective", "capacity", "--mode", "offline"], ["objective capacity needs --mode realtime"]),
    (["run", "--slo", "quality_min=0.9"], ["objective capacity needs per-request latency SLOs"]),
    (["run", "--workload", "builtin:offline"], ["workload offline has no arrival rate", "--mode offline"]),
    (["run", "--objectives", "capacity,tpot_p99_ms"], ["cannot be one of several"]),
    (["run", "--attainment", "1.5"], ["--attainment 1.5", "between 0 and 1"]),
    (["run", "--attainment", "0.8", "--slo", "attainment_min=0.9"], ["disagree"]),
    (["run", "--fidelity", "0.5"], ["--fidelity '0.5'", "ending with 1"]),
    (["run", "--fidelity", "1,0.5"], ["increasing"]),
    (["run", "--noise-repeats", "-1"], ["--noise-repeats -1"]),
    (["run", "--slo", "ttft_p99=1"], ["unknown SLO metric 'ttft_p99'", "did you mean"]),
    (["run", "--timeout", "soon"], ["--timeout 'soon'"]),
    (["run", "--trials", "0"], ["--trials"]),
    (["run", "--workload", "builtin:nope"], ["builtin:nope"]),
    (["run", "--model", "/no/such/model"], ["/no/such/model"]),
    (["show", "--study", "nope", "--db", "DB"], ["no study 'nope'"]),
    (["show", "--study", "nope", "--db", "sqlite:///missing.db"], ["no database file"]),
    (["export", "--study", "nope", "--db", "DB", "--out", "x.json"], ["no study 'nope'"]),
    (["confirm", "--study", "nope", "--db", "DB"], ["no study 'nope'"]),
    (["confirm", "--study", "nope", "--db", "DB", "--repeats", "0"], ["--repeats 0"]),
    (["list", "--db", "sqlite:///missing.db"], ["no database file"]),
    (["dashboard", "--db", "sqlite:///missing.db"], ["no database file"]),
]


@pytest.mark.parametrize("args, words", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(args, words, tmp_path, monkeypatch, capsys, bad_config):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MOETUNE_DB", raising=False)
    db = f"sqlite:///{tmp_path / 'ok.db'}"
    upgrade(db)
    args = [{"BAD_CONFIG": bad_config, "DB": db}.get(a, a) for a in args]
    if args[0] == "run" and "--db" not in args:
        args += ["--db", db]
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tuner: error: ")
    for w in words:
        assert w in lines[0]
    assert "secret" not in err


def test_list_on_an_empty_database(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'empty.db'}"
    upgrade(db)
    assert main(["list", "--db", db]) == 0
    assert "no studies yet" in capsys.readouterr().out
    assert main(["list", "--db", db, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
