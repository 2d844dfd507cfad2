"""The Plans page: a stored ``engine plan`` drawn per profile (capacity and offline throughput against the
resident budget, the table beneath), and what it says with no plan."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from db.models import PlanRun
from db.session import make_engine, session_scope, upgrade


def _stored(url: str) -> tuple[PlanRun, list]:
    db = make_engine(url)
    with session_scope(db) as s:
        plan = s.scalars(select(PlanRun)).one()
        configs = list(plan.configs)
        s.expunge_all()
    db.dispose()
    return plan, configs


def _budget(c) -> str:
    return "all" if c.budget_gib is None else f"{c.budget_gib:.1f}"


def test_plans_page_draws_the_stored_plan(planned, page, kit):
    plan, configs = _stored(planned)
    at = page("plans", planned)
    assert at.title[0].value == "Plans"
    listed = at.dataframe[0].value
    assert listed["id"].tolist() == [plan.id] and listed["configs"].tolist() == [len(configs)]
    assert listed["profiles_label"].tolist() == ["h100-pcie (datasheet)"]
    assert listed["best_capacity_rps"].iloc[0] == pytest.approx(max(c.capacity_rps for c in configs))
    text = kit.texts(at)
    assert "uncalibrated profile (datasheet)" in text and "shape:olmoe-1b-7b" in text
    assert at.subheader[0].value == "h100-pcie: NVIDIA H100 PCIe 80GB + Xeon Sapphire Rapids 56-core socket, " \
                                    "8x DDR5-4800 (AMX)"

    figures = kit.charts(at)
    suffix = " (uncalibrated profile, datasheet)"
    assert set(figures) == {f"Capacity at the SLO: h100-pcie{suffix}", f"Offline throughput: h100-pcie{suffix}"}
    for title, field in ((f"Capacity at the SLO: h100-pcie{suffix}", "capacity_rps"),
                         (f"Offline throughput: h100-pcie{suffix}", "offline_tokens_per_s")):
        fig = figures[title]
        by_name = {t["name"]: t for t in fig["data"]}
        # One line per precision x missing-expert policy of the plain rows, marked points for the others.
        lines = {(c.hi_precision, c.missing_expert) for c in configs
                 if c.expert_batching == "coalesced" and c.max_replicas == 0}
        assert sum(t["mode"] == "lines+markers" for t in fig["data"]) == len(lines)
        micro = [n for n in by_name if n.startswith("micro-batches")]
        replicas = [n for n in by_name if "replica(s)" in n]
        assert len(micro) == 1 and by_name[micro[0]]["marker"]["symbol"] == "square"
        assert len(replicas) == 1 and by_name[replicas[0]]["marker"]["symbol"] == "diamond"
        drawn = sorted((x, round(y, 6)) for t in fig["data"] for x, y in zip(t["x"], t["y"], strict=True))
        assert drawn == sorted((_budget(c), round(getattr(c, field), 6)) for c in configs)
        axis = fig["layout"]["xaxis"]
        assert axis["type"] == "category" and axis["categoryarray"][-1] == "all"
        assert axis["categoryarray"][:-1] == sorted(axis["categoryarray"][:-1], key=float)

    table = at.dataframe[1].value
    assert table["budget_gib"].tolist() == [_budget(c) for c in configs]
    assert table["missing_expert"].tolist() == [c.missing_expert or "-" for c in configs]
    assert table["capacity_rps"].tolist() == pytest.approx([c.capacity_rps for c in configs])
    assert table["tpot_p99_ms"].tolist() == pytest.approx([c.tpot_p99_ms for c in configs])


def test_a_calibrated_profile_and_an_unpriced_config(tmp_path, page, kit):
    """Stored through the store (the command's own call): two profiles, one calibrated, one config refused."""
    from db.store import add_plan

    url = f"sqlite:///{tmp_path / 'moetune.db'}"
    upgrade(url)
    row = {"hi": "int8", "missing": "host", "batching": "coalesced", "replicas": 0, "knobs": {},
           "offline_tokens_per_s": 50.0, "ttft_p99_ms": 20.0, "tpot_p99_ms": 5.0, "capacity_rps": 2.0}
    db = make_engine(url)
    with session_scope(db) as s:
        add_plan(s, model="shape:m", workload="w", workload_source="builtin:w", n_requests=3,
                 slo={"ttft_p99_ms": 1000.0, "attainment_min": 0.9},
                 profiles=[{"name": "here", "calibrated": True, "host": "this CPU", "fast": "this CPU"},
                           {"name": "there", "calibrated": False, "host": "a CPU", "fast": "a GPU"}],
                 base_config={}, software={}, wall_s=1.0,
                 rows=[{**row, "profile": "here", "budget_gib": 2.0}, {**row, "profile": "here", "budget_gib": 4.0},
                       {"profile": "there", "budget_gib": 8.0, "hi": "int4", "missing": "fetch",
                        "batching": "coalesced", "replicas": 0, "knobs": {}, "error": "does not fit"}])
    db.dispose()
    at = page("plans", url)
    assert len(at.warning) == 1 and at.warning[0].value.startswith("uncalibrated profile (datasheet)")
    assert set(kit.charts(at)) == {"Capacity at the SLO: here", "Offline throughput: here",
                                   "Capacity at the SLO: there (uncalibrated profile, datasheet)",
                                   "Offline throughput: there (uncalibrated profile, datasheet)"}
    assert kit.charts(at)["Capacity at the SLO: there (uncalibrated profile, datasheet)"]["data"] == []
    assert "1 config(s) could not be priced" in kit.texts(at)
    assert at.dataframe[2].value["error"].tolist() == ["does not fit"]
    assert at.dataframe[0].value["unpriced"].tolist() == [1]


@pytest.mark.parametrize("kind", ["blank", "migrated", "studies only"])
def test_no_plan_says_so_and_gives_the_command(tmp_path, page, kit, kind):
    path = tmp_path / "moetune.db"
    url = f"sqlite:///{path}"
    if kind == "blank":
        path.touch()
    else:
        upgrade(url)
    if kind == "studies only":  # a tuner's database: studies, no plan
        from db.store import create_study, get_or_create_model, get_or_create_workload

        db = make_engine(url)
        with session_scope(db) as s:
            model_id = get_or_create_model(s, {"fingerprint": "0123456789abcdef", "path": "m", "arch": "qwen3_moe"})
            workload_id = get_or_create_workload(s, "w", source="builtin:w", n_requests=1, duration_s=1.0)
            create_study(s, "s-00000000", model_id=model_id, workload_id=workload_id, backend="live",
                         search_space_hash="00000000", objectives=["capacity_rps"], slo={}, hardware={}, software={})
        db.dispose()
    at = page("plans", url)
    assert at.info[0].value.startswith("No plans yet")
    assert "engine plan --model" in kit.texts(at) and not kit.charts(at)


def test_no_database(tmp_path, page, kit):
    path = tmp_path / "nowhere.db"
    at = page("plans", f"sqlite:///{path}")
    assert "Cannot open the results database" in at.error[0].value and "MOETUNE_DB" in kit.texts(at)
    assert not path.exists()
