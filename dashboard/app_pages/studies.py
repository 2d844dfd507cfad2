"""Studies: every study with what it tuned, its trials by state and its best goodput."""

from __future__ import annotations

import streamlit as st

from dashboard import data, ui

url = ui.require_database()
st.title("Studies")
running_now = int(data.studies_overview(url)["running"].sum())


@st.fragment(run_every=ui.LIVE_REFRESH_S if running_now else None)
def overview() -> None:
    df = data.studies_overview(url)
    running = int(df["running"].sum())
    cols = st.columns(4)
    cols[0].metric("studies", len(df))
    cols[1].metric("trials", int(df["trials"].sum()))
    cols[2].metric("complete", int(df["complete"].sum()))
    cols[3].metric("running", running)
    if running:
        st.caption(f":green[●] {running} trial(s) running; this table re-reads the database every "
                   f"{ui.LIVE_REFRESH_S} s.")
    table = df.assign(open=[ui.page_url("study", study=n) for n in df["name"]])
    st.dataframe(
        table,
        hide_index=True,
        column_order=["open", "workload", "trials", "complete", "running", "failed", "pruned", "infeasible",
                      "best_capacity_rps", "best_goodput_rps", "gain_over_best_baseline", "slo", "objectives",
                      "model", "backend",
                      "hardware", "created_at"],
        column_config={
            "open": st.column_config.LinkColumn("study", display_text=r"study=(.*)$",
                                                help="open the study page"),
            "slo": st.column_config.TextColumn("SLO"),
            "best_capacity_rps": st.column_config.NumberColumn(
                "best capacity (req/s)", format="%.3g",
                help="highest capacity of a trial that met the SLO (one measurement; the Study page has the "
                     "confirmed figures)"),
            "best_goodput_rps": st.column_config.NumberColumn(
                "best goodput (req/s)", format="%.3g", help="best goodput of a trial that met the SLO"),
            "gain_over_best_baseline": st.column_config.NumberColumn(
                "gain over best baseline", format="x%.2f",
                help="best goodput divided by the best goodput of a baseline (defaults, llama.cpp-like, ...)"),
            "created_at": st.column_config.DatetimeColumn("created", format="YYYY-MM-DD HH:mm"),
        },
    )


overview()
st.caption("Open a study for its history, Pareto front, parameter importance and trials; "
           "the sidebar has the other views.")
