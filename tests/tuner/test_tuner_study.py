"""A short study end to end: every table filled, noise and confirmation recorded, show/list/export, the
export loaded by the engine."""

from __future__ import annotations

import json

import optuna
from optuna.trial import TrialState
from sqlalchemy import select

from db.models import (
    ExpertStatRow,
    MeasurementRow,
    Model,
    ProbeRow,
    RequestRow,
    StepRow,
    Study,
    TelemetryRow,
    Trial,
    Workload,
)
from db.session import make_engine, session_scope
from engine.cli import main as engine_main
from engine.config import EngineConfig
from tuner.cli import main
from tuner.objective import ATTR_BASELINE
from tuner.slo import DEFAULT_SLO


def test_short_study_fills_every_table_and_exports(sqlite_url, tmp_path, capsys, kit):
    FAST, MODEL, WORKLOAD, count, last_json = kit.FAST, kit.MODEL, kit.WORKLOAD, kit.count, kit.last_json
    rc = main(["run", *FAST, "--trials", "4", "--db", sqlite_url, "--study", "short", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = last_json(captured.out)
    name = report["study"]
    assert name.startswith("short-") and len(name) == len("short-") + 8
    assert report["trials"]["total"] == 4
    # Baselines come first, in registry order, as many as the trial count has room for.
    assert [b["baseline"] for b in report["baselines"]][:3] == ["defaults", "hf-static-like", "llama.cpp-like"]
    assert report["timing"]["engine_load_s"] > 0 and report["timing"]["reconfigure_median_s"] is not None
    assert "tuner dashboard" in captured.err and "tuner export" in captured.err  # --json: prose on stderr

    db = make_engine(sqlite_url)
    for table in (Study, Model, Workload, Trial, RequestRow, StepRow, ExpertStatRow, TelemetryRow, MeasurementRow,
                  ProbeRow):
        assert count(db, table) > 0, table.__tablename__
    with session_scope(db) as s:
        study = s.scalars(select(Study)).one()
        assert (study.name, study.optuna_study_name, study.backend) == (name, name, "live")
        assert study.search_space_hash == name[-8:]
        assert study.slo == DEFAULT_SLO
        assert study.objectives == ["output_tokens_per_s"]  # offline: throughput, quality floor as a constraint
        assert study.settings["mode"] == "offline" and study.settings["constraints"] == ["quality_min"]
        assert study.hardware["fingerprint"] and study.software["optuna"] == optuna.__version__
        assert study.model.identity["model"] == MODEL and study.workload.source == WORKLOAD
        trials = s.scalars(select(Trial).order_by(Trial.number)).all()
        assert [t.number for t in trials] == [0, 1, 2, 3]
        assert [t.baseline_name for t in trials[:3]] == ["defaults", "hf-static-like", "llama.cpp-like"]
        assert all(t.is_baseline for t in trials[:3])
        assert all(t.state != "running" for t in trials)
        assert all(t.error for t in trials if t.state != "complete")  # failed, infeasible, pruned: why
        done = [t for t in trials if t.state == "complete"]
        assert len(done) >= 3  # baselines always run to the end
        for t in done:
            assert t.goodput_rps is not None and t.slo_attainment is not None
            assert t.summary["reconfigure_s"] >= 0 and "constraints" in t.summary
            assert t.meta["tuner"]["engine_load_s"] > 0
            # measured against the full-precision reference (or the same knobs' measurement, cached)
            assert t.summary["quality_check"] in ("measured", "cached")
            assert 0 <= t.quality_top1_agreement <= 1 and t.quality_mean_kl is not None
            met = s.scalars(select(RequestRow.met_slo).where(RequestRow.trial_id == t.id)).all()
            assert len(met) == 6 and None not in met and sum(met) == round(t.slo_attainment * 6)

        # The noise: the defaults' search plus two repeats, run after the next two baselines.
        noise = s.scalars(select(MeasurementRow).where(MeasurementRow.purpose == "noise")
                          .order_by(MeasurementRow.id)).all()
        assert [m.trial.baseline_name for m in noise] == ["defaults", "defaults"]
        assert [m.repeat for m in noise] == [1, 2]
        assert noise[0].started_at > trials[1].finished_at.replace(tzinfo=noise[0].started_at.tzinfo)
        confirm = s.scalars(select(MeasurementRow).where(MeasurementRow.purpose == "confirm")
                            .order_by(MeasurementRow.seq)).all()
        order = [m.trial.number for m in confirm]
        k = len(set(order))
        assert len(order) == 3 * k and order == order[:k] + order[:k][::-1] + order[:k]  # A B C C B A A B C
        assert [m.repeat for m in confirm] == [r for r in range(3) for _ in range(k)]
    assert report["noise"]["n"] == 3 and report["noise"]["objective"] == "output_tokens_per_s"
    conf = report["confirmation"]
    assert conf["repeats"] == 3 and conf["order"] == order
    for c in conf["configs"]:
        iv = c["interval"]
        assert len(c["values"]) == 3 and iv["lo"] <= iv["median"] <= iv["hi"] and iv["method"] == "min-max"
    assert {g["baseline"] for g in conf["gains"]} <= {b["baseline"] for b in report["baselines"]}
    assert all(g["gain"]["lo"] <= g["gain"]["median"] <= g["gain"]["hi"] for g in conf["gains"])
    assert "confirmed (session 1)" in captured.err and "finding: " in captured.err

    # Optuna's own tables, in the same database.
    study = optuna.load_study(study_name=name, storage=sqlite_url)
    assert len(study.trials) == 4
    assert [t.user_attrs.get(ATTR_BASELINE) for t in study.trials[:3]] == [
        "defaults", "hf-static-like", "llama.cpp-like"]
    assert all(t.state.is_finished() for t in study.trials)
    assert [t.state for t in study.trials[:3]] == [TrialState.COMPLETE] * 3

    assert main(["list", "--db", sqlite_url, "--json"]) == 0
    listed = last_json(capsys.readouterr().out)
    assert [r["study"] for r in listed] == [name]
    assert main(["show", "--study", "short", "--db", sqlite_url, "--json"]) == 0
    shown = capsys.readouterr().out
    assert "finding: " in shown and "noise: the defaults measured 3 times" in shown
    assert last_json(shown)["study"] == name

    best = tmp_path / "best.json"
    assert main(["export", "--study", "short", "--db", sqlite_url, "--out", str(best)]) == 0
    assert "engine run --config" in capsys.readouterr().out
    data = json.loads(best.read_text())
    assert set(data) >= {"engine_config", "model", "workload", "hardware", "slo", "metrics", "study", "trial",
                         "confirmed", "noise"}
    assert data["trial"] == conf["export"]["number"]  # the best confirmed median is what is exported
    assert data["confirmed"] == conf["export"]["interval"]
    assert data["study"] == name and data["model"]["fingerprint"] and data["hardware"]["fingerprint"]
    with session_scope(db) as s:
        trial = s.scalars(select(Trial).where(Trial.number == data["trial"])).one()
        assert EngineConfig.from_file(best) == EngineConfig.from_dict(trial.config)
        assert EngineConfig.from_file(best).config_hash() == trial.config_hash
    assert engine_main(["run", "--config", str(best), "--model", MODEL, "--workload", WORKLOAD,
                        "--max-requests", "2", "--mode", "offline", "--quiet"]) == 0
    assert "tuned for another" not in capsys.readouterr().err

    # The same command again resumes: nothing lost, baselines not enqueued twice, one more trial.
    values = {t.number: t.values for t in study.trials}
    assert main(["run", *FAST, "--trials", "5", "--db", sqlite_url, "--study", "short", "--quiet"]) == 0
    study = optuna.load_study(study_name=name, storage=sqlite_url)
    assert len(study.trials) == 5 and {t.number: t.values for t in study.trials[:4]} == values
    names = [t.user_attrs[ATTR_BASELINE] for t in study.trials if t.user_attrs.get(ATTR_BASELINE)]
    assert len(names) == len(set(names)) == 3  # each baseline once (the peer hybrid ones need an accelerator)
    assert count(db, Trial) == 5
    assert count(db, MeasurementRow, purpose="noise") == 2  # the noise is measured once per study

    # On demand: `tuner confirm` runs another session (the resumed run confirmed once more: session 2).
    assert main(["confirm", "--study", "short", "--db", sqlite_url, "--top", "1", "--repeats", "2", "--json"]) == 0
    out = capsys.readouterr()
    conf = last_json(out.out)["confirmation"]
    assert conf["session"] == 3 and conf["repeats"] == 2 and len(conf["order"]) == 2 * len(conf["configs"])
    assert [c["baseline"] for c in conf["configs"]][-3:] == ["defaults", "hf-static-like", "llama.cpp-like"]
    assert "confirm: run 2/2" in out.err and "finding: " in out.err
    db.dispose()
