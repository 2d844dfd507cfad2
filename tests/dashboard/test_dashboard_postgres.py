"""The pages on PostgreSQL, seeded by a real short study (Optuna's tables beside ours)."""

from __future__ import annotations

import pytest

from dashboard import data
from db.testing import create_database
from tuner.cli import main as tuner_main


@pytest.fixture(scope="module")
def pg_study(pg_server, _moetune_cache):
    url = create_database(pg_server)
    args = ["run", "--model", "builtin:qwen3_moe-tiny", "--workload", "builtin:tiny", "--mode", "offline", "--max-requests", "4",
            "--trials", "4", "--study", "pg", "--db", url, "--quiet"]
    assert tuner_main(args) == 0
    yield url
    data.get_engine(url).dispose()


def test_pages_on_postgresql(pg_study, page, kit, tmp_path):
    url = pg_study
    studies = page("studies", url).dataframe[0].value
    name = studies["name"].item()
    assert name.startswith("pg-") and studies["trials"].item() == 4
    trials = kit.trials_of(url, name)
    assert studies["complete"].item() == sum(t.state == "complete" for t in trials)

    study = page("study", url, study=name)
    charts = kit.charts(study)
    assert {"Goodput vs throughput", "SLO attainment per trial",
            "Confirmed throughput (output tok/s): median and interval of 3 interleaved runs",
            "throughput (output tok/s) per trial, with the noise band of the defaults"} <= set(charts)
    assert ("Parameter importance for throughput (output tok/s)" in charts
            or "No ranking of knobs" in kit.texts(study)), kit.texts(study)
    table = next(df.value for df in study.dataframe if "config_hash" in df.value.columns)
    assert sorted(table["number"]) == [t.number for t in trials]

    trial = page("trial", url, study=name)
    assert "TTFT CDF" in kit.charts(trial) and "Tokens routed per layer and expert" in kit.charts(trial)

    out = tmp_path / "best.json"
    assert tuner_main(["export", "--study", name, "--db", url, "--out", str(out)]) == 0
    export = page("export", url, study=name)
    assert next(c.value for c in export.code if c.language == "json") == out.read_text().rstrip("\n")
