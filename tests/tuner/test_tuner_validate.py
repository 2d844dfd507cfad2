"""``tuner validate``: a simulated study's best trials re-run live, predicted against measured stored.

Real sim studies of the tiny model (``tuner run --backend sim``), validated live on this machine: one
priced by a profile stamped with this machine's hardware fingerprint (what `engine calibrate` writes,
so no --force), one by a datasheet profile (refused, then --force). Each refusal exits 2 with one line
naming the value, and stores nothing.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from sqlalchemy import func, select

from db.models import Study, Trial, Validation, ValidationMetric
from db.session import make_engine, session_scope
from db.testing import create_database
from engine.hwinfo import hardware
from engine.sim.profile import builtin_profile, machine_mismatch
from engine.sim.validate import relative_error
from tuner.cli import main

SIM = ["--backend", "sim", "--trials", "3", "--confirm-repeats", "0", "--noise-repeats", "1", "--quiet"]
#: Realtime (the default objective, capacity) on 8 requests of builtin:tiny.
CAPACITY = ["--model", "builtin:qwen3_moe-tiny", "--workload", "builtin:tiny", "--max-requests", "8"]


def _profile_file(path: Path, fingerprint: str | None) -> Path:
    """A host-only profile; with ``fingerprint``, calibrated on that machine (as `engine calibrate` marks it)."""
    data = builtin_profile("spr").to_dict()
    if fingerprint is not None:
        data.update(name="here", calibrated=True, source="engine calibrate",
                    measured={"hardware_fingerprint": fingerprint, "cpu": hardware()["cpu_model"]})
    path.write_text(json.dumps(data))
    return path


def _study_names(url: str) -> dict[str, str]:
    db = make_engine(url)
    with session_scope(db) as s:
        names = {n.rsplit("-", 1)[0]: n for n in s.scalars(select(Study.name))}
    db.dispose()
    return names


@pytest.fixture(scope="module")
def studies(tmp_path_factory, _moetune_cache):
    """One database with the studies the tests validate or refuse: ``here`` (sim, a profile calibrated on
    this machine), ``datasheet`` (sim, builtin:spr), ``other`` (sim, calibrated on another machine),
    ``nocheckpoint`` (sim of a directory holding only config.json), ``live`` (a live study)."""
    from engine.model.maker import resolve_model

    root = tmp_path_factory.mktemp("validate")
    url = f"sqlite:///{root / 'moetune.db'}"
    here = _profile_file(root / "here.json", hardware()["fingerprint"])
    other = _profile_file(root / "other.json", "0123456789ab")
    config_only = root / "config-only"
    config_only.mkdir()
    shutil.copy(resolve_model("builtin:qwen3_moe-tiny") / "config.json", config_only / "config.json")
    fast = ["--model", "builtin:qwen3_moe-tiny", "--workload", "builtin:tiny", "--mode", "offline",
            "--max-requests", "6"]
    runs = {
        "here": [*CAPACITY, *SIM, "--profile", str(here)],
        "datasheet": [*fast, *SIM, "--profile", "builtin:spr"],
        "other": [*fast, *SIM, "--trials", "1", "--profile", str(other)],
        "nocheckpoint": [*fast, *SIM, "--trials", "1", "--model", str(config_only), "--profile", "builtin:spr"],
        "live": [*fast, "--trials", "1", "--confirm-repeats", "0", "--noise-repeats", "0", "--no-quality",
                 "--quiet"],
    }
    for name, args in runs.items():
        assert main(["run", *args, "--study", name, "--db", url]) == 0, name
    return root, url, _study_names(url)


@pytest.fixture
def db_copy(studies, tmp_path):
    """A private copy of the studies' database (tests that validate write to it)."""
    root, url, names = studies
    path = tmp_path / "moetune.db"
    with closing(sqlite3.connect(root / "moetune.db")) as src, closing(sqlite3.connect(path)) as dst:
        src.backup(dst)
    return f"sqlite:///{path}", names


def _count(url: str, model) -> int:
    db = make_engine(url)
    with session_scope(db) as s:
        n = s.scalar(select(func.count()).select_from(model))
    db.dispose()
    return int(n)


def _predicted(url: str, study: str) -> dict[int, Trial]:
    db = make_engine(url)
    with session_scope(db) as s:
        sid = s.scalars(select(Study.id).where(Study.name == study)).one()
        trials = {t.number: t for t in s.scalars(select(Trial).where(Trial.study_id == sid))}
        s.expunge_all()
    db.dispose()
    return trials


def test_validate_stores_predicted_against_measured(db_copy, capsys, kit):
    url, names = db_copy
    name = names["here"]
    rc = main(["validate", "--study", "here", "--top", "2", "--repeats", "2", "--db", url, "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = kit.last_json(captured.out)
    assert report["study"] == name and report["session"] == 1 and report["forced"] is False
    assert report["mismatch"] is None and report["profile"]["name"] == "here"
    assert report["metrics"] == ["capacity_rps", "output_tokens_per_s", "ttft_p99_ms", "tpot_p99_ms"]
    assert [t["rank"] for t in report["trials"]] == [1, 2]

    # Stored: one validation, 2 trials x 4 metrics, each with both live runs and their median.
    trials = _predicted(url, name)
    db = make_engine(url)
    with session_scope(db) as s:
        v = s.scalars(select(Validation)).one()
        assert (v.top, v.repeats, v.forced, v.mismatch) == (2, 2, False, None)
        assert v.hardware["fingerprint"] == hardware()["fingerprint"] and v.profile["name"] == "here"
        rows = s.scalars(select(ValidationMetric)).all()
        assert len(rows) == 8 and {r.metric for r in rows} == set(report["metrics"])
        by_id = {t.id: t for t in trials.values()}
        for r in rows:
            t = by_id[r.trial_id]
            expected = t.summary["objectives"]["capacity_rps"] if r.metric == "capacity_rps" else getattr(t, r.metric)
            assert r.predicted == pytest.approx(expected)
            assert len(r.runs) == 2 and r.measured == pytest.approx(sorted(r.runs)[0] / 2 + sorted(r.runs)[1] / 2)
            assert r.measured > 0
    db.dispose()

    # The printed table: each trial and metric with predicted, measured and the signed relative error.
    out = captured.out
    assert f"validation 1 of study {name}: profile here (calibrated: true)" in out
    header = next(line for line in out.splitlines() if line.startswith("trial "))
    assert header.split() == ["trial", "metric", "predicted", "measured", "error"]
    for t in report["trials"]:
        for m in report["metrics"]:
            err = relative_error(t["predicted"][m], t["measured"][m])
            assert t["error"][m] == pytest.approx(err)
            assert any(m in line and f"{100 * err:+.1f}%" in line for line in out.splitlines())
    assert "median |error|: capacity_rps" in out and "(target 10%:" in out
    assert "Spearman rank correlation of capacity_rps" in out and "over 2 trials: -" in out
    med = report["summary"]["output_tokens_per_s"]["median_abs_error"]
    errs = sorted(abs(t["error"]["output_tokens_per_s"]) for t in report["trials"])
    assert med == pytest.approx(sum(errs) / 2)

    # tuner show mentions it; a second validation is session 2.
    assert main(["show", "--study", "here", "--db", url, "--json"]) == 0
    shown = capsys.readouterr().out
    assert "validated live (session 1, 2 trials x 2 runs" in shown
    assert kit.last_json(shown)["validation"]["session"] == 1
    assert main(["validate", "--study", "here", "--top", "1", "--db", url]) == 0
    assert "validation 2 of study" in capsys.readouterr().out
    assert _count(url, Validation) == 2


def test_a_datasheet_profile_is_refused_then_forced(db_copy, capsys, kit):
    url, names = db_copy
    assert main(["validate", "--study", "datasheet", "--db", url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "profile spr is a datasheet profile" in err[0] and "--force" in err[0]
    assert _count(url, Validation) == 0

    assert main(["validate", "--study", "datasheet", "--top", "2", "--force", "--db", url, "--json"]) == 0
    report = kit.last_json(capsys.readouterr().out)
    assert report["forced"] is True and "datasheet profile" in report["mismatch"]
    assert report["metrics"] == ["output_tokens_per_s", "ttft_p99_ms", "tpot_p99_ms"]  # offline: throughput
    assert len(report["trials"]) == 2 and all(t["measured"]["output_tokens_per_s"] > 0 for t in report["trials"])
    db = make_engine(url)
    with session_scope(db) as s:
        assert s.scalars(select(Validation.forced)).one() is True
    db.dispose()


@pytest.mark.parametrize("args, words", [
    (["--study", "live"], ["'live-", "live backend", "--backend sim"]),
    (["--study", "nocheckpoint"], ["config-only", "has no weights", "needs a checkpoint"]),
    (["--study", "other"], ["calibrated on another machine", "0123456789ab"]),
    (["--study", "nope"], ["no study 'nope'"]),
    (["--study", "here", "--top", "0"], ["--top 0", ">= 1"]),
    (["--study", "here", "--repeats", "0"], ["--repeats 0", ">= 1"]),
])
def test_refusals_are_one_line_and_store_nothing(args, words, db_copy, capsys):
    url, _ = db_copy
    path = Path(url.removeprefix("sqlite:///"))
    before = path.read_bytes()
    assert main(["validate", *args, "--db", url]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tuner: error: "), lines
    for w in words:
        assert w in lines[0], lines[0]
    assert path.read_bytes() == before  # not migrated, not written
    assert _count(url, Validation) == 0


def test_a_shape_has_no_weights_to_validate(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'moetune.db'}"
    assert main(["run", "--model", "shape:qwen3-30b-a3b", "--workload", "builtin:tiny", "--mode", "offline",
                 "--max-requests", "6", *SIM, "--trials", "1", "--profile", "builtin:spr", "--study", "plan",
                 "--db", url]) == 0
    capsys.readouterr()
    assert main(["validate", "--study", "plan", "--force", "--db", url]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "shape:qwen3-30b-a3b has no weights here" in line and "checkpoint" in line
    assert _count(url, Validation) == 0


def test_machine_mismatch_policy():
    here = {"fingerprint": "abc", "cpu_model": "Some CPU", "gpu": None}
    calibrated = {"name": "p", "calibrated": True, "host": "Some CPU", "device": None, "hardware_fingerprint": "abc"}
    assert machine_mismatch(calibrated, here) is None
    elsewhere = machine_mismatch({**calibrated, "hardware_fingerprint": "def"}, here)
    assert elsewhere is not None and "calibrated on another machine" in elsewhere and "def" in elsewhere
    sheet = machine_mismatch({"name": "h100-pcie", "calibrated": False, "host": "Xeon", "device": "NVIDIA H100",
                              "hardware_fingerprint": None}, here)
    assert sheet is not None and "datasheet profile of NVIDIA H100 + Xeon" in sheet and "no GPU" in sheet


def test_validate_on_postgresql(pg_server, capsys, kit, tmp_path):
    url = create_database(pg_server)
    profile = _profile_file(tmp_path / "here.json", hardware()["fingerprint"])
    assert main(["run", *CAPACITY, *SIM, "--trials", "2", "--profile", str(profile), "--study", "pg",
                 "--db", url]) == 0
    capsys.readouterr()
    assert main(["validate", "--study", "pg", "--top", "1", "--db", url, "--json"]) == 0
    report = kit.last_json(capsys.readouterr().out)
    assert report["trials"][0]["measured"]["capacity_rps"] is not None
    assert _count(url, ValidationMetric) == 4
