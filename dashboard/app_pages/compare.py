"""Compare: two to four trials of a study side by side: config differences, metric deltas and
overlaid latency CDFs."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, data, ui
from tuner.metrics import OBJECTIVES
from tuner.slo import parse_slo

url = ui.require_database()
st.title("Compare")
info = ui.pick_study(url)
trials = data.trial_list(url, info["id"])
numbers = [int(n) for n in trials["number"]]
points = data.objective_points(url, info["id"], tuple(info["objectives"]))
best = ui.best_number(url, info["name"])
baselines = [int(n) for n in points[points["is_baseline"] & (points["state"] == "complete")]["number"]]
default = list(dict.fromkeys([n for n in [best, *baselines] if n is not None]))[:2]
rows = {int(r["number"]): r for r in trials.to_dict("records")}
chosen = st.multiselect("Trials (two to four)", numbers, default=default, max_selections=4, key="trials",
                        bind="query-params",
                        help="the best trial and a baseline are chosen by default")
st.caption(" · ".join(ui.trial_label(rows[n]) for n in chosen if n in rows))
if len(chosen) < 2:
    st.info("Pick at least two trials to compare.")
    st.stop()

df = data.trials_by_number(url, info["id"], tuple(sorted(chosen)))
df = df.set_index("number").loc[[n for n in chosen if n in set(df["number"])]]
names = [f"trial {n}" + (f" [{b}]" if isinstance(b, str) and b else "") for n, b in zip(df.index, df["baseline"],
                                                                                       strict=True)]

# --- config differences
configs = {name: ui.flatten(c) for name, c in zip(names, df["config"], strict=True)}
defaults = ui.default_config()
knobs = sorted({k for c in configs.values() for k in c})
diff = [{"knob": k, "default": str(defaults.get(k, "-")), **{n: str(configs[n].get(k, "-")) for n in names}}
        for k in knobs if len({str(configs[n].get(k)) for n in names}) > 1]
st.subheader("Config differences")
if diff:
    st.dataframe(pd.DataFrame(diff), hide_index=True)
else:
    st.info("These trials ran the same config.")

# --- metric deltas
st.subheader("Metrics")
reference = names[0]
metric_rows = []
for metric in ("capacity_rps", "goodput_rps", "slo_attainment", "output_tokens_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms",
               "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "quality_top1_agreement",
               "peak_rss_bytes", "duration_s"):
    values = [float(v) if pd.notna(v) else None for v in df[metric]]
    row: dict[str, str | float | None] = {
        "metric": metric, "better": "higher" if OBJECTIVES.get(metric, "minimize") == "maximize" else "lower"}
    for name, v in zip(names, values, strict=True):
        row[name] = v
    ref = values[0]
    for n, v in zip(df.index[1:], values[1:], strict=True):
        row[f"Δ trial {n}"] = (v - ref) / abs(ref) if v is not None and ref not in (None, 0) else None
    metric_rows.append(row)
state_row = {"metric": "state", "better": "", **{n: s for n, s in zip(names, df["state"], strict=True)}}
feasible_row = {"metric": "meets SLO", "better": "", **{n: bool(f) for n, f in zip(names, df["feasible"], strict=True)}}
table = pd.DataFrame(metric_rows)
st.dataframe(
    table,
    hide_index=True,
    column_config={
        **{n: st.column_config.NumberColumn(n, format="%.4g") for n in names},
        **{c: st.column_config.NumberColumn(c, format="percent", help=f"relative to {reference}")
           for c in table.columns if c.startswith("Δ")},
    },
    height=36 * (len(table) + 1) + 4,
)
st.caption(f"Δ: change relative to {reference}; states: "
           + ", ".join(f"{n} {s}" + (" (meets SLO)" if feasible_row[n] else "") for n, s in
                       ((n, state_row[n]) for n in names)))

# --- overlaid CDFs
st.subheader("Latency distributions")
limits = parse_slo(data=info["slo"] or {}).request_limits_ms()
cols = st.columns(3)
for col, metric in zip(cols, ("ttft_ms", "tpot_ms", "e2e_ms"), strict=True):
    with col:
        curves = {name: data.latency_cdf(url, int(tid), metric) for name, tid in zip(names, df["id"], strict=True)}
        st.plotly_chart(charts.cdfs(curves, metric, limits.get(metric)), key=f"cdf_{metric}")
