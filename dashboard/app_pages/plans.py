"""Plans: what ``engine plan`` priced for machines that are not here, per profile: capacity at the SLO
and offline throughput against the resident expert budget, then the table it printed."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, data, ui

url = ui.require_plans()
st.title("Plans")
overview = data.plans_overview(url)
st.dataframe(
    overview.drop(columns=["profiles"]),
    hide_index=True,
    column_order=["id", "model", "workload", "n_requests", "profiles_label", "slo", "configs", "unpriced",
                  "best_capacity_rps", "best_offline_tokens_per_s", "wall_s", "created_at"],
    column_config={
        "id": st.column_config.NumberColumn("plan"),
        "n_requests": st.column_config.NumberColumn("requests"),
        "profiles_label": st.column_config.TextColumn("profiles"),
        "slo": st.column_config.TextColumn("SLO"),
        "unpriced": st.column_config.NumberColumn("unpriced", help="configs the simulator refused (see error)"),
        "best_capacity_rps": st.column_config.NumberColumn("best capacity (req/s)", format="%.3g"),
        "best_offline_tokens_per_s": st.column_config.NumberColumn("best offline tok/s", format="%.4g"),
        "wall_s": st.column_config.NumberColumn("wall (s)", format="%.1f"),
        "created_at": st.column_config.DatetimeColumn("planned", format="YYYY-MM-DD HH:mm"),
    },
)
labels = {str(r.id): f"plan {r.id}: {r.model} on {r.workload} ({r.profiles_label})" for r in overview.itertuples()}
choice = st.selectbox("Plan", list(labels), format_func=labels.__getitem__, key="plan", bind="query-params")
plan = overview[overview["id"] == int(choice)].iloc[0]
st.caption(" · ".join([f"model **{plan['model']}**", f"workload **{plan['workload']}** ({plan['n_requests']} "
                       "requests)", f"SLO {plan['slo']}", f"simulated in {ui.fmt(plan['wall_s'], '.1f', ' s')}"]))
configs = data.plan_configs(url, int(plan["id"]))

for profile in plan["profiles"]:
    name = profile.get("name")
    mine = configs[configs["profile"] == name]
    st.subheader(f"{name}: {profile.get('fast') or profile.get('device') or '?'} + {profile.get('host') or '?'}")
    suffix = ""
    if not profile.get("calibrated"):
        suffix = " (uncalibrated profile, datasheet)"
        st.warning("uncalibrated profile (datasheet): its figures come from a data sheet, not from "
                   "`engine calibrate` on the machine; treat them as a ranking, not a promise.")
    st.plotly_chart(charts.plan_capacity(mine, f"Capacity at the SLO: {name}{suffix}"), key=f"capacity-{name}")
    st.plotly_chart(charts.plan_throughput(mine, f"Offline throughput: {name}{suffix}"), key=f"offline-{name}")
    unpriced = int(mine["error"].notna().sum())
    if unpriced:
        st.caption(f"{unpriced} config(s) could not be priced: the error column says why.")
    st.dataframe(
        mine.drop(columns=["profile", "seq", "knobs"]).assign(
            budget_gib=charts.budget_labels(mine["budget_gib"]),
            missing_expert=mine["missing_expert"].fillna("-")),
        hide_index=True,
        column_config={
            "budget_gib": st.column_config.TextColumn("budget (GiB)"),
            "hi_precision": st.column_config.TextColumn("hi"),
            "missing_expert": st.column_config.TextColumn("missing"),
            "expert_batching": st.column_config.TextColumn("batching"),
            "max_replicas": st.column_config.NumberColumn("replicas"),
            "offline_tokens_per_s": st.column_config.NumberColumn("offline tok/s", format="%.1f"),
            "ttft_p99_ms": st.column_config.NumberColumn("p99 TTFT (ms)", format="%.0f"),
            "tpot_p99_ms": st.column_config.NumberColumn("p99 TPOT (ms)", format="%.1f"),
            "capacity_rps": st.column_config.NumberColumn("capacity (req/s)", format="%.2f"),
            "capacity_bounded": st.column_config.CheckboxColumn(
                "bracketed", help="a probe missed above the capacity (unticked: a lower bound)"),
        },
        key=f"table-{name}",
    )
st.caption("Simulated (`engine plan`): the same pure per-step decisions as the live engine, priced by each "
           "profile's cost model. `engine plan --help` for the grid; `tuner run --backend sim` to search beyond it.")
