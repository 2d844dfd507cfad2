"""Trial: metrics against the SLO, the capacity probes (attainment against arrival rate, with the knee
and the target) and where the trial's time went, the config against the defaults, latency CDFs,
requests over time, the step timeline, telemetry, per-layer expert heatmaps and, for a failed
trial, its error."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, data, ui
from tuner.slo import SLO_METRICS, parse_slo

url = ui.require_database()
st.title("Trial")
info = ui.pick_study(url)
trials = data.trial_list(url, info["id"])
if trials.empty:
    st.info("This study has no trial yet. " + ui.START_A_STUDY)
    st.stop()
best = ui.best_number(url, info["name"])
numbers = [int(n) for n in trials["number"]]
rows = {int(r["number"]): r for r in trials.to_dict("records")}
number = st.selectbox("Trial", numbers, index=numbers.index(best) if best in numbers else len(numbers) - 1,
                      key="trial", bind="query-params",
                      help="trial number in the study; the best trial is selected by default")
t = data.trial_detail(url, info["id"], number)
if t is None:
    st.warning(f"Trial {number} is no longer in the database.")
    st.stop()

st.subheader(ui.trial_label(rows[number]))
st.caption(f"config hash {t['config_hash']} · started {t['started_at']} · finished {t['finished_at'] or '-'}"
           + (" · best trial of the study" if number == best else ""))
if t["error"]:
    st.error(f"{t['state']}: {t['error']}")
if t["state"] == "running":
    st.info("This trial is still running: its measurements are stored when it finishes.")

slo = parse_slo(data=info["slo"] or {})
summary = t["summary"] or {}

# --- metrics against the SLO
if summary:
    cols = st.columns(6)
    if t.get("capacity_rps") is not None:
        cols[0].metric("capacity (req/s)", ui.fmt(t["capacity_rps"], ".4g"),
                       help="highest arrival rate at which attainment stayed at or above the target")
    else:
        cols[0].metric("goodput (req/s)", ui.fmt(t["goodput_rps"], ".4g"))
    cols[1].metric("throughput (tok/s)", ui.fmt(t["output_tokens_per_s"], ".4g"))
    cols[2].metric("SLO attainment", ui.fmt(t["slo_attainment"], ".1%"))
    cols[3].metric("TTFT p99 (ms)", ui.fmt(t["ttft_p99_ms"], ".4g"))
    cols[4].metric("TPOT p99 (ms)", ui.fmt(t["tpot_p99_ms"], ".4g"))
    cols[5].metric("peak RSS (MiB)", ui.fmt(t["peak_rss_bytes"] / 2**20 if t["peak_rss_bytes"] else None, ".4g"))
    constraints = summary.get("constraints") or {}
    slo_rows = []
    for name in slo.constraint_names():
        m = SLO_METRICS[name]
        limit = slo.bounds.get(name, slo.attainment_target)
        value = summary.get(m.summary_key)
        met = constraints.get(name)
        slo_rows.append({"bound": name, "limit": f"{'<=' if m.bound == 'max' else '>='} {ui.fmt(limit)}",
                         "measured": ui.fmt(value), "met": None if met is None else bool(met <= 0),
                         "what": m.doc})
    st.markdown("**Against the SLO** " + ("(met)" if summary.get("feasible", True) else "(missed)"))
    st.dataframe(pd.DataFrame(slo_rows, columns=["bound", "limit", "measured", "met", "what"]), hide_index=True,
                 column_config={"met": st.column_config.CheckboxColumn("met")})

# --- capacity probes and the trial's time
probes = data.trial_probes(url, t["id"])
probes = probes[probes["rate_rps"].notna()]  # offline replays have no arrival rate to draw
if len(probes):
    st.subheader("Probes")
    st.plotly_chart(charts.probes(probes, slo.attainment_target, t.get("capacity_rps")), key="probes")
    searched = probes[probes["purpose"] == "search"]
    st.caption(f"{len(searched)} replays in the trial's own search"
               + (f", {len(probes) - len(searched)} more in noise and confirmation runs" if len(probes) > len(searched)
                  else "") + ". Each replay stops once its verdict against the target is certain (open markers).")
    with st.expander("Every probe"):
        st.dataframe(probes.drop(columns=["measurement"]), hide_index=True)
if summary.get("measured_s") is not None:
    parts = [(name, summary.get(key)) for name, key in (("replays", "measured_s"), ("quality check", "quality_s"),
                                                        ("reconfigure", "reconfigure_s"), ("warm-up", "warm_up_s"),
                                                        ("overhead in all", "overhead_s"))]
    share = summary["overhead_s"] / summary["measured_s"] if summary.get("measured_s") else None
    st.caption("Time: " + ", ".join(f"{n} {ui.fmt(v, '.2f')} s" for n, v in parts)
               + (f" ({share:.1%} of the replay time)" if share is not None else "")
               + (" · quality from the cache (same maths as an earlier trial)" if summary.get("quality_cached") else ""))

# --- config against the defaults
defaults = ui.default_config()
config = ui.flatten(t["config"])
changed = [{"knob": k, "default": str(defaults.get(k, "-")), "this trial": str(v)}
           for k, v in config.items() if k not in defaults or v != defaults[k]]
st.markdown(f"**Config**: {len(changed)} knob(s) changed from the engine defaults")
if changed:
    st.dataframe(pd.DataFrame(changed), hide_index=True)
with st.expander("Whole config"):
    st.json(t["config"] or {}, expanded=False)

counts = data.request_counts(url, t["id"])
if counts["total"] == 0:
    st.info("No per-request measurements stored for this trial"
            + (" (it did not run to the end)." if t["state"] != "complete" else "."))
    st.stop()

# --- latency distributions
limits = slo.request_limits_ms()
st.subheader("Latency distributions")
st.caption(f"{counts['total']} requests: {counts['met']} met the SLO, {counts['missed']} missed"
           + (f", {counts['unknown']} not judged" if counts["unknown"] else "") + ".")
for col, metric in zip(st.columns(3), ("ttft_ms", "tpot_ms", "e2e_ms"), strict=True):
    with col:
        cdf = data.latency_cdf(url, t["id"], metric)
        st.plotly_chart(charts.cdfs({f"trial {number}": cdf}, metric, limits.get(metric)), key=f"cdf_{metric}")

# --- requests over time
st.subheader("Requests over time")
metric = st.radio("Latency", ["e2e_ms", "ttft_ms", "tpot_ms"], horizontal=True, format_func=charts.label)
sample = data.requests_sample(url, t["id"])
left, right = st.columns([3, 2])
with left:
    st.plotly_chart(charts.requests_scatter(sample, metric, limits.get(metric)), key="requests")
    if sample.attrs.get("n", len(sample)) > len(sample):
        st.caption(f"{len(sample)} of {sample.attrs['n']} requests, evenly spaced in arrival order.")
with right:
    st.plotly_chart(charts.requests_buckets(data.requests_over_time(url, t["id"])), key="buckets")

# --- steps and telemetry
steps = data.steps_timeline(url, t["id"])
readings = data.telemetry(url, t["id"])
left, right = st.columns(2)
with left:
    if len(steps):
        st.plotly_chart(charts.steps(steps), key="steps")
        if (steps["steps"] > 1).any():
            st.caption(f"{int(steps['steps'].sum())} steps in {len(steps)} time buckets.")
    else:
        st.info("No step records.")
with right:
    if len(readings):
        st.plotly_chart(charts.telemetry(readings), key="telemetry")
    else:
        st.info("No telemetry readings.")

# --- experts
experts = data.expert_stats(url, t["id"])
st.subheader("Experts per layer")
if experts.empty:
    st.info("No expert statistics stored for this trial.")
else:
    tabs = st.tabs(["tokens routed", "resident", "precision", "replicas"])
    for tab, field in zip(tabs, ("tokens", "resident", "precision", "replicas"), strict=True):
        with tab:
            st.plotly_chart(charts.expert_heatmap(experts, field), key=f"experts_{field}")
    tiers = (t["meta"] or {}).get("tiers")
    if tiers:
        st.caption("Tier traffic: " + ", ".join(f"{k} {v}" for k, v in tiers.items()))

# --- expert parallelism
ep = (t["meta"] or {}).get("ep")
if t.get("ep_ranks"):
    st.subheader("Expert parallelism")
    cols = st.columns(4)
    cols[0].metric("ranks", int(t["ep_ranks"]))
    cols[1].metric("imbalance mean", ui.fmt(t["ep_imbalance_mean"], ".3f"),
                   help="max/mean routed pairs per rank, per MoE layer over the run, averaged over layers")
    cols[2].metric("imbalance max", ui.fmt(t["ep_imbalance_max"], ".3f"), help="the most imbalanced MoE layer")
    cols[3].metric("combined per step (KiB)", ui.fmt((t["ep_bytes_combined_per_step"] or 0) / 1024, ".4g"),
                   help="bytes the ranks exchanged to combine the experts' outputs, per step (mean)")
    if ep and ep.get("tokens_per_rank_per_layer"):
        st.plotly_chart(charts.ep_ranks(ep["tokens_per_rank_per_layer"]), key="ep_ranks")
        st.caption(f"placement {ep['placement']['policy']}, combine {ep['combine']} in {ep['combine_chunks']} "
                   f"chunk(s); pairs per rank {ep['tokens_per_rank']}")

c1, c2 = st.columns(2)
with c1:
    ui.link("compare", "Compare with the best trial", study=info["name"],
            trials=[str(n) for n in dict.fromkeys([number, best]) if n is not None])
with c2:
    ui.link("export", "Export this config", study=info["name"], trial=number)
