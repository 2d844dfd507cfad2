"""Each page, run with AppTest on the seeded database: what it shows equals what the database holds."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from sqlalchemy import select

from dashboard import data, ui
from db.models import (
    ExpertStatRow,
    MeasurementRow,
    ProbeRow,
    RequestRow,
    StepRow,
    Study,
    TelemetryRow,
    Workload,
)
from db.session import make_engine, session_scope
from engine.config import EngineConfig
from tuner.cli import main as tuner_main
from tuner.export import is_feasible, ranked_trials
from tuner.findings import confirmation, noise
from tuner.metrics import pareto_ranks
from tuner.slo import parse_slo
from tuner.space import flatten
from workloads.transform import is_copy


def _rows(url, model, trial_id, order):
    db = make_engine(url)
    with session_scope(db) as s:
        rows = s.scalars(select(model).where(model.trial_id == trial_id).order_by(*order)).all()
        s.expunge_all()
    db.dispose()
    return rows


def _ranked_numbers(url, name):
    db = make_engine(url)
    with session_scope(db) as s:
        numbers = [t.number for t in ranked_trials(s, s.scalars(select(Study).where(Study.name == name)).one())]
    db.dispose()
    return numbers


def _study(url, name):
    db = make_engine(url)
    with session_scope(db) as s:
        study = s.scalars(select(Study).where(Study.name == name)).one()
        out = {"slo": study.slo, "objectives": list(study.objectives), "workload_id": study.workload_id}
    db.dispose()
    return out


def _frame_with(at, column):
    return next(df.value for df in at.dataframe if column in df.value.columns)


def _findings(url, name):
    db = make_engine(url)
    with session_scope(db) as s:
        study = s.scalars(select(Study).where(Study.name == name)).one()
        out = {"confirmation": confirmation(s, study), "noise": noise(s, study)}
    db.dispose()
    return out


def _probes(url, trial_id):
    db = make_engine(url)
    with session_scope(db) as s:
        rows = s.execute(select(ProbeRow.rate_rps, ProbeRow.attainment).join(MeasurementRow)
                         .where(MeasurementRow.trial_id == trial_id).order_by(MeasurementRow.id, ProbeRow.seq)).all()
    db.dispose()
    return [tuple(r) for r in rows]


def _markers(chart):
    """(trial number, y) of every marker trace of a chart, by trace name."""
    return {tr["name"]: list(zip(tr["x"], tr["y"], strict=True)) for tr in chart["data"] if tr.get("mode") == "markers"}


# -------------------------------------------------------------------------------- Studies


def test_studies_page_counts_trials_and_best_goodput(seed, page, kit):
    at = page("studies", seed.url)
    df = at.dataframe[0].value
    assert sorted(df["name"]) == sorted([seed.live, seed.pareto])
    for name in (seed.live, seed.pareto):
        trials = kit.trials_of(seed.url, name)
        row = df[df["name"] == name].iloc[0]
        assert row["trials"] == len(trials)
        for state in ("complete", "failed", "pruned", "infeasible", "running"):
            assert row[state] == sum(t.state == state for t in trials), state
        feasible = [t.goodput_rps for t in trials if is_feasible(t)]
        baselines = [t.goodput_rps for t in trials if t.is_baseline and t.state == "complete"]
        if feasible:
            assert row["best_goodput_rps"] == pytest.approx(max(feasible))
            assert row["gain_over_best_baseline"] == pytest.approx(max(feasible) / max(baselines))
        else:
            assert pd.isna(row["best_goodput_rps"]) and pd.isna(row["gain_over_best_baseline"])
        assert row["model"] == kit.MODEL and row["backend"] == "live" and row["hardware"]
    assert df.loc[df["name"] == seed.live, "slo"].item() == "attainment>=0.8, tpot_p99_ms<=8, ttft_p99_ms<=40"
    assert df.loc[df["name"] == seed.pareto, "objectives"].item() == "output_tokens_per_s, tpot_p99_ms"
    assert {m.label: m.value for m in at.metric}["studies"] == "2"
    assert "running" not in kit.texts(at)  # nothing runs: no live refresh note


def test_studies_page_notes_a_running_study(altered, page):
    at = page("studies", altered.url)
    df = at.dataframe[0].value
    assert df.loc[df["name"] == altered.study, "running"].item() == 1
    assert {m.label: m.value for m in at.metric}["running"] == "1"
    assert any("re-reads the database every 10 s" in c.value for c in at.caption)


# ---------------------------------------------------------------------------------- Study


def test_study_page_single_objective(seed, page, kit):
    trials = kit.trials_of(seed.url, seed.live)
    complete = [t for t in trials if t.state == "complete"]
    at = page("study", seed.url, study=seed.live)
    assert at.selectbox(key="study").value == seed.live
    charts = kit.charts(at)

    history = next(c for t, c in charts.items() if t.startswith("Optimisation history: capacity (req/s)"))
    points = [p for pts in _markers(history).values() for p in pts]
    assert sorted(n for n, _ in points) == sorted(t.number for t in complete)
    by_number = {t.number: t for t in trials}
    assert all(y == pytest.approx(by_number[n].capacity_rps) for n, y in points)
    met = [n for name, pts in _markers(history).items() if "meets SLO" in name for n, _ in pts]
    assert sorted(met) == sorted(t.number for t in complete if is_feasible(t))
    baselines = [n for name, pts in _markers(history).items() if name.startswith("baseline") for n, _ in pts]
    assert sorted(baselines) == sorted(t.number for t in complete if t.is_baseline)

    scatter = charts["Goodput vs throughput"]
    assert sum(len(tr["x"]) for tr in scatter["data"]) == len(complete)
    bars = charts["SLO attainment per trial"]["data"][0]
    assert dict(zip(bars["x"], bars["y"], strict=True)) == pytest.approx(
        {t.number: t.slo_attainment for t in complete})

    knobs = set(flatten(EngineConfig().to_dict()))
    found = _findings(seed.url, seed.live)
    if "Parameter importance for capacity (req/s)" in charts:
        importance = charts["Parameter importance for capacity (req/s)"]["data"][0]
        assert importance["y"] and set(importance["y"]) <= knobs
        assert sum(importance["x"]) == pytest.approx(1.0, abs=1e-6)
        assert f"Noise of the objective on this machine: {found['noise'].rel_spread:.1%}" in kit.texts(at)
    else:  # the trials spread no wider than the noise: the page says so instead of ranking knobs
        assert "No ranking of knobs" in kit.texts(at)

    # The confirmed figures come first: one bar per confirmed config, its median with the interval.
    conf = found["confirmation"]
    bars = charts[f"Confirmed capacity (req/s): median and interval of {conf['repeats']} interleaved runs"]["data"][0]
    expected = {c["label"]: c["interval"] for c in conf["configs"] if c["interval"]}
    assert set(bars["x"]) == set(expected)
    for x, y, up, down in zip(bars["x"], bars["y"], bars["error_y"]["array"], bars["error_y"]["arrayminus"],
                              strict=True):
        iv = expected[x]
        assert (y, y + up, y - down) == (pytest.approx(iv["median"]), pytest.approx(iv["hi"]), pytest.approx(iv["lo"]))
    gains = _frame_with(at, "verdict")
    assert gains["over"].tolist() == [g["baseline"] for g in conf["gains"]]
    if conf["best"] is not None:
        assert ui.finding_text(conf) in kit.texts(at)
    # Each trial's own search with the defaults' noise band behind it.
    per_trial = charts["capacity (req/s) per trial, with the noise band of the defaults"]
    band = next(sh for sh in per_trial["layout"]["shapes"] if sh["type"] == "rect")
    assert (band["y0"], band["y1"]) == (pytest.approx(found["noise"].lo), pytest.approx(found["noise"].hi))
    parcoords = charts["Parallel coordinates over the knobs"]["data"][0]
    varying = {k for k in knobs if len({str(flatten(t.config).get(k)) for t in complete}) > 1}
    assert len(parcoords["dimensions"]) == len(varying) + 1

    best = _ranked_numbers(seed.url, seed.live)[0]
    assert f"Open trial {best}" in [link.label for link in at.get("page_link")]
    table = _frame_with(at, "config_hash")
    assert sorted(table["number"]) == [t.number for t in trials]
    capacity = table["capacity_rps"].dropna().tolist()
    assert capacity == sorted(capacity, reverse=True)  # sorted by the objective, best first
    assert table["capacity_rps"].isna().tolist() == sorted(table["capacity_rps"].isna().tolist())  # missing last
    state = next(m for m in at.multiselect if m.label == "State")
    at = state.set_value(["complete"]).run()
    table = _frame_with(at, "config_hash")
    assert sorted(table["number"]) == sorted(t.number for t in complete) and set(table["state"]) == {"complete"}
    assert f"{len(complete)} trial(s) match" in kit.texts(at)


def test_study_page_pareto_front(seed, page, kit):
    trials = kit.trials_of(seed.url, seed.pareto)
    feasible = [t for t in trials if is_feasible(t)]
    values = [[t.summary["objectives"]["output_tokens_per_s"], t.summary["objectives"]["tpot_p99_ms"]]
              for t in feasible]
    front = sorted(v[0] for v, r in zip(values, pareto_ranks(values, ["maximize", "minimize"]), strict=True)
                   if r == 0)
    at = page("study", seed.url, study=seed.pareto)
    chart = kit.charts(at)["Pareto front"]
    drawn = next(tr for tr in chart["data"] if tr["name"] == "Pareto front (meets SLO)")
    assert sorted(drawn["x"]) == pytest.approx(front)
    assert sum(len(tr["x"]) for tr in chart["data"] if tr["mode"] == "markers") == sum(
        t.state == "complete" for t in trials)
    assert "Optimisation history: throughput (output tok/s) (maximize)" in kit.charts(at)


def test_study_page_while_a_trial_runs(altered, page):
    at = page("study", altered.url, study=altered.study)
    assert {m.label: m.value for m in at.metric}["running"] == "1"
    assert any("refreshing every 10 s" in c.value for c in at.caption)


# ---------------------------------------------------------------------------------- Trial


def test_trial_page_shows_the_best_trial(seed, page, kit):
    best = _ranked_numbers(seed.url, seed.live)[0]
    trial = next(t for t in kit.trials_of(seed.url, seed.live) if t.number == best)
    at = page("trial", seed.url, study=seed.live)  # no trial given: the best one
    assert at.selectbox(key="trial").value == best
    assert at.subheader[0].value.startswith(f"trial {best}")

    slo = parse_slo(data=_study(seed.url, seed.live)["slo"])
    assert _frame_with(at, "bound")["bound"].tolist() == slo.constraint_names()
    defaults = flatten(EngineConfig().to_dict())
    changed = sorted(k for k, v in flatten(trial.config).items() if v != defaults[k])
    shown = _frame_with(at, "knob")["knob"].tolist() if changed else []
    assert sorted(shown) == changed
    assert f"{len(changed)} knob(s) changed" in kit.texts(at)

    requests = _rows(seed.url, RequestRow, trial.id, [RequestRow.id])
    charts = kit.charts(at)
    probes = charts["Capacity probes: attainment against arrival rate"]
    markers = [tr for tr in probes["data"] if tr["mode"] == "markers"]
    drawn = sorted((round(x, 9), round(y, 9)) for tr in markers for x, y in zip(tr["x"], tr["y"], strict=True))
    assert drawn == sorted((round(x, 9), round(y, 9)) for x, y in _probes(seed.url, trial.id))
    assert [sh["y0"] for sh in probes["layout"]["shapes"]] == [parse_slo(data=_study(seed.url, seed.live)["slo"])
                                                               .attainment_target]  # the target
    knees = [tr for tr in probes["data"] if tr["mode"] == "lines"]
    if trial.capacity_rps:
        (knee,) = knees
        assert knee["x"] == [trial.capacity_rps] * 2 and knee["name"].startswith("knee")
    else:  # a loaded machine: even the best trial met the target at no rate it probed, so no knee
        assert knees == []
    ttft = charts["TTFT CDF"]["data"][0]
    values = sorted(r.ttft_ms for r in requests if r.ttft_ms is not None)
    step = math.ceil(len(values) / data.MAX_POINTS)  # a replay of more requests is drawn at evenly spaced ranks
    assert ttft["x"] == pytest.approx([v for i, v in enumerate(values) if i % step == 0 or i == len(values) - 1])
    assert ttft["y"][-1] == 1.0
    scatter = charts["Requests over time"]["data"]
    by_arrival = sorted(requests, key=lambda r: (r.arrival_s, r.id))
    step = math.ceil(len(by_arrival) / data.MAX_POINTS)
    drawn = [r for i, r in enumerate(by_arrival) if i % step == 0 or i == len(by_arrival) - 1]
    assert sum(len(tr["x"]) for tr in scatter) == len(drawn)
    met = next((tr for tr in scatter if tr["name"] == "met SLO"), {"x": []})
    assert len(met["x"]) == sum(bool(r.met_slo) for r in drawn)
    buckets = charts["Arrivals per time bucket, met and missed"]["data"]
    assert sum(sum(tr["y"]) for tr in buckets) == len(requests)

    steps = _rows(seed.url, StepRow, trial.id, [StepRow.step])
    timeline = charts["Step timeline"]["data"][0]
    if len(steps) <= data.MAX_POINTS:
        assert len(timeline["x"]) == len(steps) and timeline["y"] == [s.batch_seqs for s in steps]
    else:  # bucketed in time: at most MAX_POINTS buckets of mean batch sizes
        seqs = [s.batch_seqs for s in steps]
        assert len(timeline["x"]) <= data.MAX_POINTS + 1 and timeline["x"] == sorted(timeline["x"])
        assert min(seqs) <= min(timeline["y"]) and max(timeline["y"]) <= max(seqs)
    experts = _rows(seed.url, ExpertStatRow, trial.id, [ExpertStatRow.layer, ExpertStatRow.expert])
    heat = charts["Tokens routed per layer and expert"]["data"][0]
    assert sum(v for row in heat["z"] for v in row) == sum(e.tokens for e in experts)
    assert {"Resident in the fast tier per layer and expert", "Precision per layer and expert",
            "Replicas per layer and expert"} <= set(charts)
    if _rows(seed.url, TelemetryRow, trial.id, [TelemetryRow.t_s]):
        assert "Telemetry" in charts


def test_trial_page_shows_why_a_trial_failed(seed, altered, page, kit):
    """Every trial the realtime run pruned or found infeasible (how many depends on this machine's speed
    and noise), and one the engine refused outright (the altered copy's trial 998, always there)."""
    cases = [(seed.url, t) for t in kit.trials_of(seed.url, seed.live) if t.state in ("infeasible", "pruned", "failed")]
    refused = next(t for t in kit.trials_of(altered.url, altered.study) if t.number == 998)
    assert refused.state == "infeasible" and "int4_group_size=48" in refused.error
    for url, failed in [(altered.url, refused), *cases[:2]]:
        at = page("trial", url, study=seed.live, trial=failed.number)
        assert at.error[0].value == f"{failed.state}: {failed.error}"
        assert at.subheader[0].value.startswith(f"trial {failed.number}")
        if not _rows(url, RequestRow, failed.id, [RequestRow.id]):
            assert "No per-request measurements" in kit.texts(at)


# -------------------------------------------------------------------------------- Compare


def test_compare_page(seed, page, kit):
    trials = kit.trials_of(seed.url, seed.live)
    complete = [t for t in trials if t.state == "complete"]
    a, b = complete[0], complete[-1]
    at = page("compare", seed.url, study=seed.live, trials=[a.number, b.number])
    assert at.multiselect(key="trials").value == [a.number, b.number]
    fa, fb = flatten(a.config), flatten(b.config)
    diff = _frame_with(at, "knob")
    assert sorted(diff["knob"]) == sorted(k for k in fa if str(fa[k]) != str(fb.get(k)))
    metrics = _frame_with(at, "metric").set_index("metric")
    name_a = next(c for c in metrics.columns if c.startswith(f"trial {a.number}"))
    name_b = next(c for c in metrics.columns if c.startswith(f"trial {b.number}"))
    assert metrics.loc["goodput_rps", name_a] == pytest.approx(a.goodput_rps)
    assert metrics.loc["goodput_rps", name_b] == pytest.approx(b.goodput_rps)
    delta = metrics.loc["goodput_rps", f"Δ trial {b.number}"]
    if a.goodput_rps:
        assert delta == pytest.approx((b.goodput_rps - a.goodput_rps) / a.goodput_rps)
    else:  # relative to nothing (a loaded machine can leave a trial at 0): no change is claimed
        assert delta is None or delta != delta  # None or NaN
    for title in ("TTFT CDF", "TPOT CDF", "E2E latency CDF"):
        assert [tr["name"] for tr in kit.charts(at)[title]["data"]] == [name_a, name_b]

    one = page("compare", seed.url, study=seed.live, trials=[a.number])
    assert "Pick at least two trials" in kit.texts(one)


# ------------------------------------------------------------------------------ Workloads


def _workload_label(url, study):
    db = make_engine(url)
    with session_scope(db) as s:
        w = s.get(Workload, _study(url, study)["workload_id"])
        label = f"{w.name} ({w.fingerprint[:8]})"
    db.dispose()
    return label


def test_workloads_page_from_the_workload_file(seed, page, kit):
    at = page("workloads", seed.url, workload=_workload_label(seed.url, seed.live))
    charts = kit.charts(at)
    assert sum(charts["Arrival rate over time"]["data"][0]["customdata"]) == 16
    assert sum(charts["Prompt length distribution"]["data"][0]["y"]) == 16
    assert sum(charts["Output length distribution"]["data"][0]["y"]) == 16
    trace = charts["Share of tokens per expert, router trace"]["data"][0]
    assert len(trace["z"]) == 2 and all(sum(row) == pytest.approx(1.0) for row in trace["z"])  # 2 MoE layers
    assert [tr["name"] for tr in charts["Expert popularity drift"]["data"]] == ["layer 0", "layer 1"]
    complete = sum(t.state == "complete" for t in kit.trials_of(seed.url, seed.live))
    stored = charts[f"Share of tokens per expert, {complete} trial(s)"]["data"][0]
    assert all(sum(row) == pytest.approx(1.0) for row in stored["z"])
    table = at.dataframe[0].value
    assert set(table["name"]) == {"bursty16", "tiny"}

    tiny = page("workloads", seed.url, workload=_workload_label(seed.url, seed.pareto))
    assert "Drift over time needs a router trace" in kit.texts(tiny)
    assert sum(kit.charts(tiny)["Prompt length distribution"]["data"][0]["y"]) == 12  # builtin:tiny's file


def test_workloads_page_without_the_file_uses_a_stored_replay(altered, page, kit):
    """The workload's 16 requests, from the stored replay, without the copies its probes added (the seed
    replays 16 requests at 24 req/s and up: under 2 s, so every probe is cycled)."""
    at = page("workloads", altered.url, workload=_workload_label(altered.url, altered.study))
    assert "is not readable here" in kit.texts(at)
    replay = data.workload_replay_trial(altered.url, _study(altered.url, altered.study)["workload_id"])
    stored = _rows(altered.url, RequestRow, replay, [RequestRow.id])
    assert len(stored) > 16 and sum(is_copy(r.request_id) for r in stored) == len(stored) - 16
    charts = kit.charts(at)
    assert sum(charts["Arrival rate over time"]["data"][0]["customdata"]) == 16
    assert sum(charts["Prompt length distribution"]["data"][0]["y"]) == 16


# --------------------------------------------------------------------------------- Export


@pytest.mark.parametrize("rank", [1, 2])
def test_export_page_is_the_tuner_export_file(seed, page, tmp_path, rank):
    out = tmp_path / "best.json"
    assert tuner_main(["export", "--study", seed.live, "--db", seed.url, "--rank", str(rank), "--out", str(out)]) == 0
    number = _ranked_numbers(seed.url, seed.live)[rank - 1]
    at = page("export", seed.url, study=seed.live, **({"trial": number} if rank > 1 else {}))
    shown = next(c.value for c in at.code if c.language == "json")
    assert shown == out.read_text().rstrip("\n")  # st.code drops the final newline; the download keeps it
    assert data.export_text(seed.url, seed.live, rank) == out.read_text()  # what the download button serves
    assert at.download_button[0].label == "Download the config"
    assert any(f"--rank {rank}" in c.value for c in at.code)
    ranking = _frame_with(at, "rank")
    assert ranking["number"].tolist() == _ranked_numbers(seed.url, seed.live)
    assert not math.isnan(ranking["capacity_rps"].iloc[0])
    if rank == 1:  # the best confirmed config, with its confirmed figures
        assert "Confirmed capacity_rps" in " ".join(m.value for m in at.markdown)
