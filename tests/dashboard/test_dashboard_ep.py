"""The Trial page of an expert-parallel trial: ranks, imbalance and combine bytes from the trial's columns, and
the routed pairs per rank and MoE layer from its ``meta.ep``. A real short simulated study of the tiny model
on a two-GPU datasheet profile, read back independently through the ORM."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from db.models import Study, Trial
from db.session import make_engine, session_scope

from .conftest import MODEL


@pytest.fixture(scope="module")
def ep_study(tmp_path_factory, _moetune_cache):
    from tuner.cli import main as tuner_main

    url = f"sqlite:///{tmp_path_factory.mktemp('dashboard-ep') / 'moetune.db'}"
    assert tuner_main(["run", "--model", MODEL, "--workload", "builtin:tiny", "--max-requests", "8", "--mode",
                       "offline", "--objectives", "output_tokens_per_s", "--backend", "sim", "--profile",
                       "builtin:h100-sxm*2", "--fix", "parallel.ep_size=2", "--trials", "2", "--confirm-repeats",
                       "0", "--noise-repeats", "1", "--study", "ep", "--db", url, "--quiet"]) == 0
    db = make_engine(url)
    with session_scope(db) as s:
        name = s.scalars(select(Study.name)).one()
        t = s.scalars(select(Trial).where(Trial.state == "complete").order_by(Trial.number)).first()
        row = {"number": t.number, "ranks": t.ep_ranks, "imbalance": t.ep_imbalance_mean, "ep": t.meta["ep"]}
    db.dispose()
    return url, name, row


def test_trial_page_shows_the_ranks_of_an_expert_parallel_trial(ep_study, page, kit):
    url, name, row = ep_study
    assert row["ranks"] == 2 and row["imbalance"] >= 1.0
    at = page("trial", url, study=name, trial=str(row["number"]))
    assert "Expert parallelism" in kit.texts(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["ranks"] == "2" and float(metrics["imbalance mean"]) == pytest.approx(row["imbalance"], abs=1e-3)
    chart = kit.charts(at)["Routed pairs per rank and MoE layer"]
    bars = [tr for tr in chart["data"] if tr["type"] == "bar"]
    assert [tr["name"] for tr in bars] == ["rank 0", "rank 1"]
    per_layer = row["ep"]["tokens_per_rank_per_layer"]
    assert [list(tr["y"]) for tr in bars] == [[float(r[i]) for r in per_layer] for i in range(2)]


def test_a_one_rank_trial_has_no_expert_parallel_section(seed, page, kit):
    at = page("trial", seed.url, study=seed.live)
    assert "Expert parallelism" not in kit.texts(at) and "ranks" not in {m.label for m in at.metric}
