"""The data module on a large trial and a study of hundreds of trials, on SQLite and PostgreSQL:
aggregation and downsampling happen in SQL, so no call returns more rows than a chart draws."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from sqlalchemy import select

from dashboard import data
from db.models import Study
from db.session import make_engine, session_scope, upgrade
from db.store import create_study, finish_trial, get_or_create_model, get_or_create_workload, start_trial
from db.testing import create_database
from engine.config import EngineConfig

N_REQUESTS, N_STEPS, N_TELEMETRY, N_TRIALS = 5000, 4000, 300, 300
LAYERS, EXPERTS = 48, 64


def _big_result(rng: random.Random) -> tuple[dict, dict]:
    requests, met = [], {}
    for i in range(N_REQUESTS):
        rejected = i % 500 == 7  # a few never got a token
        ttft = None if rejected else rng.uniform(10, 2000)
        requests.append({
            "request_id": f"r{i}", "arrival_s": i * 0.01, "prompt_tokens": rng.randint(8, 2000),
            "output_tokens": rng.randint(1, 500), "ttft_ms": ttft, "tpot_ms": None if rejected else rng.uniform(5, 90),
            "e2e_ms": None if rejected else ttft + rng.uniform(100, 9000), "first_token_s": None, "finish_s": None,
            "finish_reason": "rejected" if rejected else "length"})
        met[f"r{i}"] = bool(i % 3)
    steps = [{"step": i, "start_s": i * 0.0125, "duration_ms": rng.uniform(1, 20), "batch_seqs": rng.randint(1, 64),
              "prefill_tokens": rng.randint(0, 512), "decode_tokens": rng.randint(0, 64)} for i in range(N_STEPS)]
    telemetry = [{"t_s": i * 0.25, "cpu_percent": rng.uniform(0, 100), "rss_bytes": 2**30 + i,
                  "gpu_util_percent": None, "gpu_mem_bytes": None, "gpu_power_w": None} for i in range(N_TELEMETRY)]
    experts = [{"layer": layer, "expert": e, "tokens": rng.randint(0, 10_000), "resident": e % 2 == 0,
                "precision": "int4", "replicas": 0} for layer in range(LAYERS) for e in range(EXPERTS)]
    summary = {"output_tokens_per_s": 100.0, "feasible": False, "objectives": {"goodput_rps": 0.5}}
    return {"summary": summary, "meta": {}, "requests": requests, "steps": steps, "telemetry": telemetry,
            "expert_stats": experts}, met


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def big(request, tmp_path_factory):
    """A study of N_TRIALS small trials plus one trial with thousands of every record."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('big') / 'moetune.db'}"
    else:
        url = create_database(request.getfixturevalue("pg_server"))
    upgrade(url)
    db = make_engine(url)
    rng = random.Random(0)
    config = EngineConfig()
    with session_scope(db) as s:
        model_id = get_or_create_model(s, {"fingerprint": "0123456789abcdef", "path": "/m", "arch": "qwen3_moe"})
        workload_id = get_or_create_workload(s, "big", source="/nowhere/big", n_requests=N_REQUESTS)
        study_id = create_study(s, "big-00000000", model_id=model_id, workload_id=workload_id, backend="live",
                                search_space_hash="00000000", objectives=["goodput_rps"], slo={"ttft_p99_ms": 1000},
                                hardware={}, software={})
        for n in range(N_TRIALS):
            tid = start_trial(s, study_id, n, config.to_dict(), f"{n:016x}", is_baseline=n < 3,
                              baseline_name=f"b{n}" if n < 3 else None)
            feasible = n % 2 == 0
            finish_trial(s, tid, {"summary": {"feasible": feasible, "objectives": {"goodput_rps": float(n)}}},
                         "complete", slo_attainment=0.9 if feasible else 0.5, goodput_rps=float(n))
        big_id = start_trial(s, study_id, N_TRIALS, config.to_dict(), "f" * 16)
        result, met = _big_result(rng)
        finish_trial(s, big_id, result, "complete", slo_attainment=2 / 3, goodput_rps=0.5, met_slo_per_request=met)
    db.dispose()
    yield {"url": url, "trial_id": big_id, "study_id": study_id, "result": result, "met": met}
    data.get_engine(url).dispose()


def test_cdf_takes_evenly_spaced_ranks_in_sql(big):
    ttft = np.sort([r["ttft_ms"] for r in big["result"]["requests"] if r["ttft_ms"] is not None])
    cdf = data.latency_cdf(big["url"], big["trial_id"], "ttft_ms", max_points=200)
    n = len(ttft)
    step = math.ceil(n / 200)
    ranks = list(range(1, n + 1, step)) + ([n] if (n - 1) % step else [])
    assert len(cdf) == len(ranks) <= 201 and cdf.attrs["n"] == n
    assert cdf["value"].to_numpy() == pytest.approx(ttft[np.array(ranks) - 1])
    assert cdf["fraction"].to_numpy() == pytest.approx(np.array(ranks) / n)
    assert cdf["fraction"].iloc[-1] == 1.0


def test_requests_are_sampled_and_bucketed_in_sql(big):
    url, tid = big["url"], big["trial_id"]
    sample = data.requests_sample(url, tid, max_points=500)
    assert len(sample) <= 501 and sample.attrs["n"] == N_REQUESTS
    assert sample["arrival_s"].is_monotonic_increasing
    assert (sample["arrival_s"].iloc[0], sample["arrival_s"].iloc[-1]) == pytest.approx((0.0, (N_REQUESTS - 1) * 0.01))
    buckets = data.requests_over_time(url, tid, buckets=60)
    assert len(buckets) <= 61
    assert buckets["requests"].sum() == N_REQUESTS and buckets["met"].sum() == sum(big["met"].values())
    counts = data.request_counts(url, tid)
    assert (counts["total"], counts["met"], counts["missed"]) == (
        N_REQUESTS, sum(big["met"].values()), N_REQUESTS - sum(big["met"].values()))
    for column in ("prompt_tokens", "output_tokens"):
        hist = data.length_histogram(url, tid, column, bins=40)
        assert len(hist) <= 41 and hist["requests"].sum() == N_REQUESTS
        assert hist["lo"].iloc[0] == min(r[column] for r in big["result"]["requests"])


def test_steps_are_bucketed_and_telemetry_thinned(big):
    steps = big["result"]["steps"]
    timeline = data.steps_timeline(big["url"], big["trial_id"], max_points=100)
    assert len(timeline) <= 101
    assert timeline["steps"].sum() == N_STEPS
    assert timeline["prefill_tokens"].sum() == sum(s["prefill_tokens"] for s in steps)
    assert timeline["duration_max_ms"].max() == pytest.approx(max(s["duration_ms"] for s in steps))
    readings = data.telemetry(big["url"], big["trial_id"], max_points=50)
    assert len(readings) <= 51 and readings["t_s"].is_monotonic_increasing
    experts = data.expert_stats(big["url"], big["trial_id"])
    assert len(experts) == LAYERS * EXPERTS and experts["tokens"].sum() == sum(
        e["tokens"] for e in big["result"]["expert_stats"])


def test_trials_are_counted_filtered_and_paged_in_sql(big):
    url, sid = big["url"], big["study_id"]
    overview = data.studies_overview(url).iloc[0]
    assert (overview["trials"], overview["complete"], overview["running"]) == (N_TRIALS + 1, N_TRIALS + 1, 0)
    best = max(n for n in range(N_TRIALS) if n % 2 == 0)
    assert overview["best_goodput_rps"] == best
    assert overview["gain_over_best_baseline"] == pytest.approx(best / 2)  # baselines 0, 1, 2: the best feasible is 2
    page, total = data.trials_table(url, sid, sort_by="goodput_rps", descending=True, limit=200, offset=200)
    assert total == N_TRIALS + 1 and len(page) == N_TRIALS + 1 - 200
    assert page["goodput_rps"].is_monotonic_decreasing
    feasible, n_feasible = data.trials_table(url, sid, kind="feasible", limit=10)
    assert n_feasible == N_TRIALS // 2 and len(feasible) == 10 and feasible["meets_slo"].all()
    assert data.trials_table(url, sid, kind="baselines")[1] == 3
    points = data.objective_points(url, sid, ("goodput_rps",))
    assert len(points) == N_TRIALS + 1 and points["obj_0"].iloc[5] == 5.0
    assert points["feasible"].sum() == N_TRIALS // 2
    configs = data.top_configs(url, sid, "goodput_rps", "maximize", limit=20)
    assert len(configs) == 20 and configs["value"].iloc[0] == N_TRIALS - 1
    with pytest.raises(ValueError, match="cannot sort"):
        data.trials_table(url, sid, sort_by="goodput_rps; DROP TABLE mt_trials")


def test_the_dashboard_cannot_write(big):
    engine = data.get_engine(big["url"])
    with pytest.raises(Exception, match="(?i)read.?only|readonly"), engine.begin() as conn:
        conn.execute(Study.__table__.delete())
    with session_scope(make_engine(big["url"])) as s:
        assert s.scalars(select(Study.name)).all() == ["big-00000000"]
