"""No database, an empty one, and a study with no finished trial: every page explains, none raises."""

from __future__ import annotations

import pandas as pd
import pytest

from db.session import make_engine, session_scope, upgrade
from db.store import create_study, get_or_create_model, get_or_create_workload, start_trial
from engine.config import EngineConfig
from tuner.slo import DEFAULT_SLO

PAGES = ["studies", "study", "trial", "compare", "workloads", "export"]


@pytest.mark.parametrize("name", PAGES)
def test_missing_database(tmp_path, page, kit, name):
    path = tmp_path / "nowhere.db"
    at = page(name, f"sqlite:///{path}")
    assert "Cannot open the results database" in at.error[0].value and "nowhere.db" in at.error[0].value
    assert "MOETUNE_DB" in kit.texts(at)
    assert not path.exists()  # read-only: the dashboard never creates a database


@pytest.mark.parametrize("name", ["studies", "trial"])
def test_unusable_database_url(page, kit, name):
    at = page(name, "not a database url")
    assert at.error[0].value.startswith("Cannot open the results database: not a database URL")
    assert "MOETUNE_DB" in kit.texts(at)


@pytest.mark.parametrize("kind", ["blank", "migrated"])
@pytest.mark.parametrize("name", PAGES)
def test_empty_database(tmp_path, page, kit, name, kind):
    path = tmp_path / "moetune.db"
    url = f"sqlite:///{path}"
    if kind == "migrated":
        upgrade(url)
    else:
        path.touch()
    at = page(name, url)
    assert at.info[0].value.startswith("No studies yet")
    assert "tuner run" in kit.texts(at)


@pytest.fixture(scope="module")
def unfinished(tmp_path_factory):
    """A study whose only trial (the defaults baseline) is still running."""
    url = f"sqlite:///{tmp_path_factory.mktemp('unfinished') / 'moetune.db'}"
    upgrade(url)
    db = make_engine(url)
    config = EngineConfig()
    with session_scope(db) as s:
        model_id = get_or_create_model(s, {"fingerprint": "0123456789abcdef", "path": "/models/tiny",
                                           "arch": "qwen3_moe", "model": "builtin:qwen3_moe-tiny"})
        workload_id = get_or_create_workload(s, "tiny", source="builtin:tiny", n_requests=12, duration_s=2.75)
        study_id = create_study(s, "waiting-00000000", model_id=model_id, workload_id=workload_id, backend="live",
                                search_space_hash="00000000", objectives=["goodput_rps"], slo=DEFAULT_SLO,
                                hardware={"cpu_model": "test CPU", "cpu_cores": 2}, software={})
        start_trial(s, study_id, 0, config.to_dict(), config.config_hash(), is_baseline=True,
                    baseline_name="defaults")
    db.dispose()
    return url


def test_no_finished_trial(unfinished, page, kit):
    studies = page("studies", unfinished)
    row = studies.dataframe[0].value.iloc[0]
    assert (row["running"], row["complete"]) == (1, 0) and pd.isna(row["best_goodput_rps"])

    study = page("study", unfinished, study="waiting-00000000")
    assert "No finished trial yet" in kit.texts(study) and "1 trial(s) running" in kit.texts(study)
    assert study.dataframe[0].value["state"].tolist() == ["running"]
    assert not kit.charts(study)

    trial = page("trial", unfinished)
    assert "still running" in kit.texts(trial) and "No per-request measurements" in kit.texts(trial)
    assert trial.subheader[0].value == "trial 0 [defaults], running"

    assert "Pick at least two trials" in kit.texts(page("compare", unfinished))
    assert "no complete trial to export" in kit.texts(page("export", unfinished))
    workloads = page("workloads", unfinished)
    assert "No complete trial stored expert statistics" in kit.texts(workloads)
    assert "Arrival rate over time" in kit.charts(workloads)  # from the built-in workload's file
