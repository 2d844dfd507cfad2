"""``engine plan --db``: the plan it prints is the plan it stores; a bad URL stops it before any pricing."""

from __future__ import annotations

import json
import time

from sqlalchemy import select

from db.models import PlanConfig, PlanRun
from db.session import make_engine, session_scope
from engine.cli import main as engine_main

PLAN = ["plan", "--model", "shape:olmoe-1b-7b", "--profile", "builtin:h100-pcie", "--workload", "builtin:tiny",
        "--max-requests", "4", "--max-batch-seqs", "8", "--max-seq-len-tokens", "1024", "--slo", "ttft_p99_ms=500",
        "--slo", "tpot_p99_ms=50", "--quiet", "--json"]
COLUMNS = ["budget_gib", "hi", "missing", "batching", "replicas", "offline_tokens_per_s", "ttft_p99_ms", "tpot_p99_ms",
           "capacity_rps", "error"]


def _cell(value, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def _printed(config: PlanConfig) -> list[str]:
    """A stored config as ``engine plan`` prints its row (whitespace-split)."""
    return [
        "all" if config.budget_gib is None else format(config.budget_gib, ".1f"), config.hi_precision,
        config.missing_expert or "-", config.expert_batching, str(config.max_replicas),
        _cell(config.offline_tokens_per_s, ".1f"), _cell(config.ttft_p99_ms, ".0f"), _cell(config.tpot_p99_ms, ".1f"),
        _cell(config.capacity_rps, ".2f"), *(config.error or "-").split(),
    ]


def test_plan_stores_what_it_prints(tmp_path, monkeypatch, capsys):
    """Stored in ``$MOETUNE_DB`` without ``--db`` (the tuner's default): one plan row with the model, workload,
    SLO, profiles (calibrated false), software and wall time; one config row per printed row, equal cell by cell."""
    url = f"sqlite:///{tmp_path / 'plans.db'}"
    monkeypatch.setenv("MOETUNE_DB", url)
    monkeypatch.chdir(tmp_path)
    before = time.time()
    assert engine_main(PLAN) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    header = next(i for i, ln in enumerate(lines) if ln.split() == COLUMNS)
    table = [ln.split() for ln in lines[header + 1:] if ln.strip() and not ln.startswith(("stored", "{"))]
    assert f"stored as plan {out['plan_id']} in {url}" in lines[-2]
    assert not (tmp_path / "moetune.db").exists()

    db = make_engine(url)
    with session_scope(db) as s:
        plan = s.scalars(select(PlanRun)).one()
        assert plan.id == out["plan_id"]
        assert (plan.model, plan.workload, plan.workload_source, plan.n_requests) == (
            "shape:olmoe-1b-7b", "tiny", "builtin:tiny", 4)
        assert plan.slo == {"ttft_p99_ms": 500, "tpot_p99_ms": 50, "attainment_min": 0.9}
        assert [(p["name"], p["calibrated"], p["fast"]) for p in plan.profiles] == [
            ("h100-pcie", False, "NVIDIA H100 PCIe 80GB")]
        assert plan.software["torch"] == "not used (simulated)" and plan.software["python"]
        assert plan.base_config["scheduler"]["max_batch_seqs"] == 8
        assert 0 < plan.wall_s < time.time() - before + 1
        assert before - 1 < plan.created_at.timestamp() < time.time()
        configs = plan.configs
        assert [c.seq for c in configs] == list(range(len(table))) and len(table) > 10
        assert [_printed(c) for c in configs] == table
        assert [c.knobs for c in configs] == [r["knobs"] for r in out["rows"]]
        # Full precision in the database, not the printed rounding.
        assert [c.capacity_rps for c in configs] == [r["capacity_rps"] for r in out["rows"]]
        assert [c.capacity_bounded for c in configs] == [r["capacity_bounded"] for r in out["rows"]]
        assert {c.profile for c in configs} == {"h100-pcie"}
        assert {c.expert_batching for c in configs} == {"coalesced", "micro"}
        assert max(c.max_replicas for c in configs) == 1
    db.dispose()


def test_plan_refuses_a_bad_database_url_before_pricing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for url, message in (("nope://x", "unknown database driver 'nope'"),
                         (f"sqlite:///{tmp_path / 'gone' / 'x.db'}", "does not exist"),
                         ("not a url", "not a database URL")):
        t0 = time.perf_counter()
        assert engine_main([*PLAN, "--db", url]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("engine: error: ") and message in err[0], err
        assert captured.out == "" and time.perf_counter() - t0 < 5  # refused before the grid is priced
    assert engine_main([*PLAN, "--db", f"sqlite:///{tmp_path / 'x.db'}", "--no-db"]) == 2
    assert "--no-db: pick one" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
