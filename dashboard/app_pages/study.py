"""Study: the confirmed finding first (each confirmed config's median and interval, the gain over every
baseline), a simulated study's figures against live runs (``tuner validate``), the noise of this machine, each trial's value with the noise band, optimisation history,
Pareto front, parameter importance (or why there is none), parallel coordinates, SLO attainment and a
sortable, filterable table of trials."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, data, ui
from tuner.metrics import pareto_ranks
from tuner.slo import parse_slo

url = ui.require_database()
st.title("Study")
info = ui.pick_study(url)
st.markdown(ui.study_caption(info))
objectives = tuple(info["objectives"])
directions = info["directions"]
running_now = data.state_counts(url, info["id"])["running"]


@st.fragment(run_every=ui.LIVE_REFRESH_S if running_now else None)
def progress() -> None:
    counts = data.state_counts(url, info["id"])
    cols = st.columns(6)
    for col, key in zip(cols, ("total", "complete", "running", "failed", "pruned", "infeasible"), strict=True):
        col.metric(key if key != "total" else "trials", counts[key])
    points = data.objective_points(url, info["id"], objectives)
    best = ui.best_number(url, info["name"])
    if best is None:
        st.info("No finished trial yet: charts appear when the first trial completes."
                + (f" {counts['running']} trial(s) running; this view refreshes every {ui.LIVE_REFRESH_S} s."
                   if counts["running"] else ""))
        return
    row = points[points["number"] == best].iloc[0]
    verdict = "meets the SLO" if row["feasible"] else "**no trial met the SLO**; the closest is"
    values = ", ".join(f"{charts.label(o)} {ui.fmt(row[f'obj_{i}'])}" for i, o in enumerate(objectives))
    st.markdown(f"Best: {verdict} trial {best}" + (f" [{row['baseline_name']}]" if row["is_baseline"] else "")
                + f": {values}")
    c1, c2, c3 = st.columns(3)
    with c1:
        ui.link("trial", f"Open trial {best}", study=info["name"], trial=best)
    with c2:
        ui.link("export", "Export its config", study=info["name"], trial=best)
    with c3:
        ui.link("compare", "Compare with the baselines", study=info["name"],
                trials=[str(n) for n in [best, *points[points["is_baseline"]]["number"].head(3)] if n is not None])
    if counts["running"]:
        st.caption(f":green[●] {counts['running']} trial(s) running; refreshing every {ui.LIVE_REFRESH_S} s.")
    st.plotly_chart(charts.history(points, objectives[0], directions[0]), key="history")


def finding() -> None:
    """The confirmed figures, the noise and what the multi-fidelity search spent."""
    f = data.findings(url, info["name"])
    conf, noise = f["confirmation"], f["noise"]
    st.subheader("Finding")
    if conf:
        st.plotly_chart(charts.confirmed(conf), key="confirmed")
        rows = [{"over": g["baseline"], "gain": (g["gain"] or {}).get("median"), "low": (g["gain"] or {}).get("lo"),
                 "high": (g["gain"] or {}).get("hi"), "runs": (g["gain"] or {}).get("n"), "verdict": g["verdict"]}
                for g in conf["gains"]]
        best = conf["best"]
        if best is not None:
            st.markdown(f"**{ui.finding_text(conf)}**")
            st.caption(f"Best confirmed: {best['label']}; session {conf['session']}, {conf['repeats']} runs of each "
                       "config interleaved (A B C A B C ...), order " + " ".join(map(str, conf["order"])) + ".")
        if rows:
            st.dataframe(pd.DataFrame(rows), hide_index=True, column_config={
                c: st.column_config.NumberColumn(c, format="x%.2f") for c in ("gain", "low", "high")})
    else:
        st.info("Not confirmed yet: these are single measurements. `tuner confirm --study "
                f"{info['name']}` re-runs the top configs and every baseline, interleaved, with intervals.")
    cols = st.columns(4)
    cols[0].metric("noise (spread of the defaults)", ui.fmt(noise["rel_spread"], ".1%") if noise else "-",
                   help="(max - min) / median of the default config's repeated runs on this machine")
    fid, tm = f["fidelity"], f["time"]
    cols[1].metric("promoted to the whole workload", ui.fmt(fid["fraction_promoted"], ".0%"),
                   help=f"{fid['promoted']} of {fid['searched']} searched trials; the others stopped early or were "
                        "pruned on a prefix")
    cols[2].metric("replay time saved (s)", ui.fmt(fid["time_saved_s"], ".0f"))
    cols[3].metric("overhead / replay time", ui.fmt(tm["overhead_share"], ".1%"),
                   help="reconfigure, warm-up and probe set-up, over the seconds of replays")
    if noise:
        st.caption(f"Noise: the defaults measured {noise['n']} times: "
                   + ", ".join(ui.fmt(v, ".4g") for v in noise["values"]) + f" ({charts.label(noise['objective'])}).")
    if len(objectives) == 1:
        values = data.search_values(url, info["id"])
        if len(values):
            st.plotly_chart(charts.per_trial(values, objectives[0], noise), key="per_trial")


def validated() -> None:
    """A simulated study: its best trials' predicted figures against live runs (``tuner validate``)."""
    st.subheader("Simulated against live")
    got = data.validation(url, info["name"])
    if got is None:
        st.info(f"Not validated live: these figures are the simulator's. `tuner validate --study {info['name']}` "
                "re-runs the best trials on the machine the profile describes and stores predicted against measured.")
        return
    report, rows = got["report"], got["rows"]
    profile = report["profile"] or {}
    st.caption(f"Validation {report['session']}: profile {profile.get('name')} (calibrated: "
               f"{str(bool(profile.get('calibrated'))).lower()}) against {report['repeats']} live run(s) of each of "
               f"{len(report['trials'])} trials on machine {report['hardware_fingerprint']} (the median).")
    if report["forced"]:
        st.warning(f"Forced (--force): {report['mismatch']}")
    summary = report["summary"] or {}
    cols = st.columns(len(report["metrics"]) + 1)
    for col, m in zip(cols, report["metrics"], strict=False):
        s = summary.get(m) or {}
        col.metric(f"median |error| {m}", ui.fmt(s.get("median_abs_error"), ".1%"),
                   help=f"target {s['target']:.0%}" if s.get("target") is not None else None)
    sp = summary.get("spearman") or {}
    cols[-1].metric(f"Spearman {sp.get('metric')}", ui.fmt(sp.get("rho"), ".2f"),
                    help="rank correlation of predicted and measured over the trials (needs 3 or more)")
    st.dataframe(rows.drop(columns=["number", "baseline"]), hide_index=True, column_config={
        "predicted": st.column_config.NumberColumn("predicted (sim)", format="%.4g"),
        "measured": st.column_config.NumberColumn("measured (live)", format="%.4g"),
        "error": st.column_config.NumberColumn("error", format="percent", help="(predicted - measured) / measured")})
    metrics = report["metrics"]
    for i in range(0, len(metrics), 2):
        for col, m in zip(st.columns(2), metrics[i:i + 2], strict=False):
            with col:
                st.plotly_chart(charts.predicted_vs_measured(rows, m), key=f"validated_{m}")

finding()
if info["backend"] == "sim":
    validated()
progress()

points = data.objective_points(url, info["id"], objectives)
complete = points[(points["state"] == "complete") & points["obj_0"].notna()]
if not complete.empty:
    left, right = st.columns(2)
    with left:
        if len(objectives) >= 2:
            done = complete.dropna(subset=["obj_1"])
            feasible = done[done["feasible"]]
            ranks = pareto_ranks(feasible[["obj_0", "obj_1"]].to_numpy().tolist(), directions[:2]) if len(feasible) else []
            front = [int(n) for n, r in zip(feasible["number"], ranks, strict=True) if r == 0]
            st.plotly_chart(charts.pareto(points, objectives, directions, front), key="pareto")
            if len(objectives) > 2:
                st.caption(f"The front is drawn over the first two of {len(objectives)} objectives.")
        else:
            st.plotly_chart(charts.goodput_vs_throughput(points), key="scatter")
    with right:
        target = parse_slo(data=info["slo"] or {}).attainment_target
        st.plotly_chart(charts.attainment(points, target), key="attainment")

    imp = data.param_importance(url, info["optuna_study_name"], 0, directions[0])
    f = data.findings(url, info["name"])
    noise = f["noise"]
    if f["within_noise"]:
        st.subheader("Parameter importance")
        st.info(f"No ranking of knobs: the complete trials' {objectives[0]} spread no wider than the noise of "
                + (f"this machine (the defaults' runs spread {noise['rel_spread']:.1%} over {noise['n']} runs)"
                   if noise else "this machine (they are all equal)") + ", so any ranking would be a ranking of noise.")
    elif "importances" in imp and imp["importances"]:
        st.plotly_chart(charts.importance(imp["importances"], objectives[0]), key="importance")
        st.caption(f"PED-ANOVA over {imp['n_trials']} complete trials (Optuna): how much each knob decides "
                   "whether a trial lands among the best. Noise of the objective on this machine: "
                   + (f"{noise['rel_spread']:.1%} (the defaults, {noise['n']} runs)." if noise else "not measured."))
    else:
        st.subheader("Parameter importance")
        st.info(imp.get("message") or "No knob varied between complete trials.")

    configs = data.top_configs(url, info["id"], objectives[0], directions[0])
    flat = pd.DataFrame([ui.flatten(c) for c in configs["config"]])
    knobs = [k for k in flat.columns if flat[k].astype(str).nunique() > 1]
    if len(configs) >= 2 and knobs:
        st.plotly_chart(charts.parallel_coordinates(pd.concat([flat, configs[["value"]]], axis=1), knobs,
                                                    objectives[0]), key="parcoords")
        st.caption(f"The {len(configs)} best complete trials by {objectives[0]}, over the {len(knobs)} knobs "
                   "that differ between them.")
    else:
        st.subheader("Parallel coordinates")
        st.info("Needs at least two complete trials with different knob values.")

st.subheader("Trials")
f1, f2, f3, f4, f5 = st.columns([3, 2, 2, 1, 1])
states = f1.multiselect("State", data.STATES, default=[], placeholder="every state")
kind = f2.selectbox("Show", ["all", "baselines", "searched", "feasible", "infeasible"],
                    help="feasible: complete and met the SLO; infeasible: complete but missed it")
sort_by = f3.selectbox("Sort by", data.SORTABLE, index=data.SORTABLE.index(objectives[0])
                       if objectives[0] in data.SORTABLE else 0)
descending = f4.toggle("Descending", value=sort_by != "number" and data.TRIAL_METRICS.get(sort_by) is not None
                       and directions[0] == "maximize")
page_size = 200
table, total = data.trials_table(url, info["id"], tuple(states), kind, sort_by, descending, limit=page_size,
                                 offset=0)
pages = max(1, -(-total // page_size))
page = f5.number_input("Page", min_value=1, max_value=pages, value=1, step=1)
if page > 1:
    table, total = data.trials_table(url, info["id"], tuple(states), kind, sort_by, descending, limit=page_size,
                                     offset=(page - 1) * page_size)
table = table.assign(open=[ui.page_url("trial", study=info["name"], trial=int(n)) for n in table["number"]])
st.dataframe(
    table,
    hide_index=True,
    placeholder="-",
    column_order=["open", "state", "baseline", "meets_slo", *data.TABLE_METRICS, "config_hash", "error"],
    column_config={
        "open": st.column_config.LinkColumn("trial", display_text=r"trial=(\d+)$"),
        "meets_slo": st.column_config.CheckboxColumn("meets SLO"),
        "slo_attainment": st.column_config.ProgressColumn("SLO attainment", format="percent", min_value=0,
                                                          max_value=1),
        "fidelity": st.column_config.ProgressColumn("fidelity", format="percent", min_value=0, max_value=1,
                                                    help="share of the workload the trial was last measured on"),
        "peak_rss_bytes": st.column_config.NumberColumn("peak RSS", format="bytes"),
        **{m: st.column_config.NumberColumn(m, format="%.4g") for m in data.TABLE_METRICS
           if m not in ("slo_attainment", "peak_rss_bytes", "fidelity")},
    },
)
st.caption(f"{total} trial(s) match; showing {len(table)} (page {page} of {pages}), sorted in the database.")
