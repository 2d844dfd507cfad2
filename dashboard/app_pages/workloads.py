"""Workloads: arrival rate over time, prompt and output lengths, and per-layer expert popularity
and drift, from the workload file when it is at hand, else from what the trials stored."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, data, ui

url = ui.require_database()
st.title("Workloads")
overview = data.workloads_overview(url)
st.dataframe(
    overview.drop(columns=["id", "meta"]),
    hide_index=True,
    column_config={
        "n_requests": st.column_config.NumberColumn("requests"),
        "duration_s": st.column_config.NumberColumn("duration (s)", format="%.3g"),
        "complete_trials": st.column_config.NumberColumn("complete trials"),
        "created_at": st.column_config.DatetimeColumn("first used", format="YYYY-MM-DD HH:mm"),
    },
)
labels = [f"{n} ({fp[:8]})" for n, fp in zip(overview["name"], overview["fingerprint"], strict=True)]
choice = st.selectbox("Workload", labels, key="workload", bind="query-params")
w = overview.iloc[labels.index(choice)]
meta = w["meta"] if isinstance(w["meta"], dict) else {}
st.caption(" · ".join(str(x) for x in [
    f"source `{w['source']}`" if w["source"] else "source unknown",
    f"{w['n_requests']} requests over {ui.fmt(w['duration_s'], '.3g')} s",
    meta.get("description") or meta.get("origin") or "",
] if x))

file = data.workload_file(w["source"])
replay = data.workload_replay_trial(url, int(w["id"]))

# --- arrivals and lengths
st.subheader("Arrivals and lengths")
if "message" not in file:
    cols = st.columns(4)
    cols[0].metric("requests", file["n_requests"])
    cols[1].metric("duration", ui.fmt(file["duration_s"], ".3g", " s"))
    cols[2].metric("mean rate", ui.fmt(file["rate_per_s"], ".3g", " req/s"))
    cols[3].metric("burstiness (CV of gaps)", ui.fmt(file["burstiness_cv"], ".3g"))
    left, mid, right = st.columns(3)
    left.plotly_chart(charts.arrival_rate(file["arrivals"]), key="arrivals")
    mid.plotly_chart(charts.length_histogram(file["lengths"]["prompt_tokens"], "prompt_tokens"), key="prompt")
    right.plotly_chart(charts.length_histogram(file["lengths"]["output_tokens"], "output_tokens"), key="output")
    st.caption(f"From the workload file `{w['source']}`.")
elif replay is not None:
    st.info(f"{file['message']} Showing the requests of one replay stored in the database instead "
            "(the workload's own, not the copies a capacity probe replayed to reach its minimum span).")
    buckets = data.requests_over_time(url, replay, originals_only=True)
    arrivals = pd.DataFrame({"t_s": buckets["t_s"], "requests": buckets["requests"],
                             "rate_per_s": buckets["requests"] / buckets["width_s"]})
    left, mid, right = st.columns(3)
    left.plotly_chart(charts.arrival_rate(arrivals), key="arrivals")
    mid.plotly_chart(charts.length_histogram(data.length_histogram(url, replay, "prompt_tokens", originals_only=True), "prompt_tokens"),
                     key="prompt")
    right.plotly_chart(charts.length_histogram(data.length_histogram(url, replay, "output_tokens", originals_only=True), "output_tokens"),
                       key="output")
    st.caption("Arrival times as replayed: an offline replay sends every request at t = 0.")
else:
    st.info(f"{file['message']} No complete trial replayed it yet either.")

# --- experts
st.subheader("Expert popularity")
left, right = st.columns(2)
with left:
    popularity = data.workload_expert_popularity(url, int(w["id"]))
    if popularity.empty:
        st.info("No complete trial stored expert statistics for this workload yet.")
    else:
        n_trials = int(popularity["trials"].max())
        st.plotly_chart(charts.popularity(popularity, f"Share of tokens per expert, {n_trials} trial(s)"),
                        key="popularity_trials")
        st.caption("Tokens routed per expert, summed over every complete trial on this workload "
                   "(routing knobs such as top_k_override change it a little).")
router = file.get("router") if "message" not in file else None
with right:
    if router is not None:
        hot = router["hotness"]
        shares = pd.DataFrame([{"layer": layer, "expert": e, "share": float(hot[layer, e])}
                               for layer in range(hot.shape[0]) for e in range(hot.shape[1])])
        st.plotly_chart(charts.popularity(shares, "Share of tokens per expert, router trace"), key="popularity_trace")
if router is not None:
    left, right = st.columns(2)
    with left:
        st.plotly_chart(charts.drift(router["drift"], router["window_tokens"]), key="drift")
    with right:
        stats = router["stats"]
        st.dataframe(pd.DataFrame({"layer": range(len(stats["top10_share"])), "top-10% share": stats["top10_share"],
                                   "entropy (1 = uniform)": stats["entropy_norm"], "drift (TV)": stats["drift_tv"]}),
                     hide_index=True)
        st.caption(f"Router trace of {router['n_tokens']} tokens recorded with {router['model'].get('arch')} "
                   f"({router['model'].get('fingerprint')}); windows of {router['window_tokens']} tokens.")
else:
    st.info("Drift over time needs a router trace in the workload: "
            "`workloads record --model MODEL --workload W --out DIR`, then tune on DIR.")
