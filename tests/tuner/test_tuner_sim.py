"""``tuner run --backend sim --profile P``: a study whose trials the simulator prices, recorded as such."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from db.models import RequestRow, StepRow, Study, Trial
from db.session import make_engine, session_scope, upgrade
from tuner.cli import main


def test_short_sim_study_records_backend_and_profile(sqlite_url, capsys, kit):
    rc = main(["run", *kit.FAST, "--backend", "sim", "--profile", "builtin:h100-pcie", "--trials", "4",
               "--confirm-repeats", "0", "--noise-repeats", "1", "--db", sqlite_url, "--study", "simq", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = kit.last_json(captured.out)
    assert report["trials"]["total"] == 4
    assert report["timing"]["weights_load_s"] == 0.0  # no weights were loaded
    assert "priced by profile h100-pcie (calibrated: false)" in captured.err
    assert "no quality check" in captured.err  # said, not silently dropped

    db = make_engine(sqlite_url)
    with session_scope(db) as s:
        study = s.scalars(select(Study)).one()
        assert study.backend == "sim"
        assert study.settings["profile"]["name"] == "h100-pcie" and study.settings["calibrated"] is False
        assert study.settings["quality"] is False
        # The study's hardware is the profile's machine, not the one the simulation ran on.
        assert "H100" in study.hardware["gpu"]["name"] and study.hardware["fingerprint"] == "profile:h100-pcie"
        trials = s.scalars(select(Trial).order_by(Trial.number)).all()
        assert [t.number for t in trials] == [0, 1, 2, 3]
        done = [t for t in trials if t.state == "complete"]
        assert len(done) >= 3
        for t in done:
            assert t.output_tokens_per_s and t.output_tokens_per_s > 0 and t.tpot_p99_ms and t.tpot_p99_ms > 0
            assert t.summary["quality_check"] == "off"
            assert t.meta["backend"] == "sim" and t.meta["calibrated"] is False
            assert t.meta["profile"]["name"] == "h100-pcie"
            assert s.scalars(select(RequestRow).where(RequestRow.trial_id == t.id)).all()
            assert s.scalars(select(StepRow).where(StepRow.trial_id == t.id)).all()
        # Simulated time is deterministic: the same config twice gives the same figure.
        by_config: dict[str, set[float]] = {}
        for t in done:
            by_config.setdefault(t.config_hash, set()).add(round(t.output_tokens_per_s, 6))
        assert all(len(v) == 1 for v in by_config.values())


@pytest.mark.parametrize("args, words", [
    (["--backend", "stub"], ["--backend stub", "live or sim"]),
    (["--backend", "sim"], ["--backend sim needs --profile"]),
    (["--profile", "builtin:h100-pcie"], ["need --backend sim"]),
    (["--backend", "sim", "--profile", "builtin:nope"], ["nope"]),
])
def test_bad_sim_flags_are_one_line(args, words, sqlite_url, capsys, kit):
    upgrade(sqlite_url)
    assert main(["run", *kit.FAST, *args, "--trials", "2", "--db", sqlite_url]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tuner: error: "), lines
    for w in words:
        assert w in lines[0]


def test_sim_json_report_is_last_line(sqlite_url, capsys, kit):
    assert main(["run", *kit.FAST, "--backend", "sim", "--profile", "builtin:spr", "--trials", "1",
                 "--confirm-repeats", "0", "--noise-repeats", "0", "--db", sqlite_url, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1])["trials"]["total"] == 1
