"""Plotly figures of the dashboard: pure functions from the data module's frames to figures.

Every figure carries a title (tests find charts by it). Colours keep one meaning everywhere:
feasible (met the SLO) green, infeasible red, baselines drawn as diamonds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.metrics import label as metric_label

MET = "#2ca02c"
MISSED = "#d62728"
BASELINE = "#7f7f7f"  # also: requests not judged against the SLO
PALETTE = ("#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")

LABELS = {
    "ttft_ms": "TTFT (ms)",
    "tpot_ms": "TPOT (ms)",
    "e2e_ms": "E2E latency (ms)",
}


def label(name: str) -> str:
    """A readable axis label for a metric name (the metrics table's, ``engine.metrics``)."""
    return LABELS.get(name) or metric_label(name)


def _layout(fig: go.Figure, title: str, height: int = 360, **kw: Any) -> go.Figure:
    kw.setdefault("margin", {"l": 10, "r": 10, "t": 50, "b": 10})
    # Legends go under the plot: above it they collide with the title in half-width columns.
    kw.setdefault("legend", {"orientation": "h", "yanchor": "top", "y": -0.22, "xanchor": "left", "x": 0.0})
    fig.update_layout(title={"text": title}, height=height, **kw)
    return fig


def _trial_text(df: pd.DataFrame) -> list[str]:
    return [f"trial {n}" + (f" [{b}]" if isinstance(b, str) and b else "")
            for n, b in zip(df["number"], df["baseline_name"], strict=True)]


def _groups(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame, dict[str, Any]]]:
    """Complete trials in the four marker groups every study chart uses: colour tells whether a
    trial met the SLO, a diamond marks a baseline."""
    searched, base = df[~df["is_baseline"]], df[df["is_baseline"]]
    diamond = {"symbol": "diamond", "size": 12, "line": {"width": 1, "color": "black"}}
    return [
        ("meets SLO", searched[searched["feasible"]], {"color": MET, "symbol": "circle", "size": 9}),
        ("misses SLO", searched[~searched["feasible"]], {"color": MISSED, "symbol": "x", "size": 9}),
        ("baseline, meets SLO", base[base["feasible"]], {"color": MET, **diamond}),
        ("baseline, misses SLO", base[~base["feasible"]], {"color": MISSED, **diamond}),
    ]


def history(points: pd.DataFrame, objective: str, direction: str) -> go.Figure:
    """Each complete trial's objective by trial number, and the best feasible value so far."""
    done = points[points["state"] == "complete"].dropna(subset=["obj_0"])
    fig = go.Figure()
    for name, g, marker in _groups(done):
        if len(g):
            fig.add_trace(go.Scatter(x=g["number"], y=g["obj_0"], mode="markers", name=name, marker=marker,
                                     text=_trial_text(g), hovertemplate="%{text}<br>%{y:.4g}<extra></extra>"))
    feasible = done[done["feasible"]].sort_values("number")
    if len(feasible):
        best = feasible["obj_0"].cummax() if direction == "maximize" else feasible["obj_0"].cummin()
        fig.add_trace(go.Scatter(x=feasible["number"], y=best, mode="lines", name="best so far (meets SLO)",
                                 line={"shape": "hv", "color": MET}))
    fig.update_xaxes(title="trial")
    fig.update_yaxes(title=label(objective))
    return _layout(fig, f"Optimisation history: {label(objective)} ({direction})")


NOISE = "rgba(127, 127, 127, 0.18)"


def per_trial(values: pd.DataFrame, objective: str, noise: Mapping[str, Any] | None) -> go.Figure:
    """Each trial's search on the whole workload, with the band the defaults' repeats fell in.

    A search stopped early (the config could not beat the best so far) is drawn at the value it
    missed at, as a downward triangle: its own value lies below.
    """
    fig = go.Figure()
    if noise:
        fig.add_hrect(y0=noise["lo"], y1=noise["hi"], fillcolor=NOISE, line_width=0, layer="below")
        fig.add_hline(y=noise["median"], line={"dash": "dot", "color": BASELINE},
                      annotation_text=f"defaults: {noise['n']} runs, spread {noise['rel_spread']:.1%}")
    done = values.dropna(subset=["value"])
    for name, g, marker in _groups(done):
        if len(g):
            fig.add_trace(go.Scatter(x=g["number"], y=g["value"], mode="markers", name=name, marker=marker,
                                     text=_trial_text(g), hovertemplate="%{text}<br>%{y:.4g}<extra></extra>"))
    stopped = values[values["value"].isna() & values["upper_bound"].notna()]
    if len(stopped):
        fig.add_trace(go.Scatter(x=stopped["number"], y=stopped["upper_bound"], mode="markers",
                                 name="stopped early (below this)",
                                 marker={"symbol": "triangle-down-open", "size": 10, "color": MISSED},
                                 text=_trial_text(stopped), hovertemplate="%{text}<br>< %{y:.4g}<extra></extra>"))
    fig.update_xaxes(title="trial")
    fig.update_yaxes(title=label(objective), rangemode="tozero")
    return _layout(fig, f"{label(objective)} per trial, with the noise band of the defaults")


def confirmed(conf: Mapping[str, Any]) -> go.Figure:
    """The confirmed configs: median and interval of their interleaved runs, best first."""
    configs = sorted((c for c in conf["configs"] if c["interval"]), key=lambda c: c["interval"]["median"],
                     reverse=conf["direction"] == "maximize")
    labels = [c["label"] for c in configs]
    med = [c["interval"]["median"] for c in configs]
    colours = [BASELINE if c["baseline"] else MET for c in configs]
    fig = go.Figure(go.Bar(
        x=labels, y=med, marker={"color": colours}, name="median",
        error_y={"type": "data", "symmetric": False, "array": [c["interval"]["hi"] - m for c, m in zip(configs, med,
                                                                                                   strict=True)],
                 "arrayminus": [m - c["interval"]["lo"] for c, m in zip(configs, med, strict=True)]},
        customdata=[[c["interval"]["lo"], c["interval"]["hi"], c["interval"]["n"]] for c in configs],
        hovertemplate="%{x}: %{y:.4g} (%{customdata[0]:.4g}-%{customdata[1]:.4g}, %{customdata[2]} runs)"
                      "<extra></extra>"))
    fig.update_xaxes(title="config (grey: baseline)", type="category")
    fig.update_yaxes(title=label(conf["objective"]), rangemode="tozero")
    return _layout(fig, f"Confirmed {label(conf['objective'])}: median and interval of {conf['repeats']} "
                        "interleaved runs")


def predicted_vs_measured(rows: pd.DataFrame, metric: str) -> go.Figure:
    """One metric of a validation: each trial's simulated figure against its live one, with the line
    y = x on which a perfect prediction lies."""
    done = rows[(rows["metric"] == metric)].dropna(subset=["predicted", "measured"])
    fig = go.Figure()
    if len(done):
        lo = float(min(done["predicted"].min(), done["measured"].min()))
        hi = float(max(done["predicted"].max(), done["measured"].max()))
        fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="y = x (exact prediction)",
                                 line={"dash": "dot", "color": BASELINE}, hoverinfo="skip"))
    fig.add_trace(go.Scatter(
        x=done["predicted"], y=done["measured"], mode="markers", name="trial", text=done["trial"],
        customdata=done["error"], marker={"color": PALETTE[0], "size": 10},
        hovertemplate="%{text}<br>predicted %{x:.4g}, measured %{y:.4g} (error %{customdata:+.1%})<extra></extra>"))
    fig.update_xaxes(title=f"predicted (sim): {label(metric)}")
    fig.update_yaxes(title=f"measured (live): {label(metric)}")
    return _layout(fig, f"Predicted vs measured: {label(metric)}", height=320)


def probes(df: pd.DataFrame, target: float | None, capacity_rps: float | None) -> go.Figure:
    """A trial's capacity probes: attainment against arrival rate, per measurement, with the target
    and the knee. Open markers: probes stopped once their verdict was certain (a bound)."""
    fig = go.Figure()
    for i, ((purpose, fidelity, _measurement), g) in enumerate(df.groupby(["purpose", "fidelity", "measurement"],
                                                                          sort=False)):
        name = f"{purpose}, {'whole workload' if fidelity >= 1 else f'{fidelity:.0%} of it'}"
        symbols = [("circle" if m else "x") + ("-open" if s else "") for m, s in zip(g["met"], g["stopped"],
                                                                                      strict=True)]
        fig.add_trace(go.Scatter(
            x=g["rate_rps"], y=g["attainment"], mode="markers", name=name, legendgroup=name,
            showlegend=name not in {tr.name for tr in fig.data},
            marker={"symbol": symbols, "size": 10, "color": [MET if m else MISSED for m in g["met"]],
                    "line": {"color": PALETTE[i % len(PALETTE)], "width": 2}},
            customdata=np.stack([g["seq"] + 1, g["duration_s"], g["n_requests"]], axis=-1),
            hovertemplate="probe %{customdata[0]}: %{x:.3g} req/s, attainment %{y:.0%}<br>"
                          "%{customdata[2]} requests, %{customdata[1]:.1f} s<extra></extra>"))
    if target is not None:
        fig.add_hline(y=target, line={"dash": "dash", "color": "black"}, annotation_text=f"target {target:.0%}")
    if capacity_rps:
        # A trace, not a shape: shapes on a log axis take log10 coordinates.
        fig.add_trace(go.Scatter(x=[capacity_rps, capacity_rps], y=[0, 1], mode="lines",
                                 name=f"knee {capacity_rps:.3g} req/s", line={"dash": "dot", "color": MET},
                                 hoverinfo="skip"))
    fig.update_xaxes(title="arrival rate (req/s)", type="log")
    fig.update_yaxes(title="SLO attainment", range=[-0.03, 1.05], tickformat=".0%")
    return _layout(fig, "Capacity probes: attainment against arrival rate", height=400)


def pareto(points: pd.DataFrame, objectives: Sequence[str], directions: Sequence[str],
           front: Sequence[int]) -> go.Figure:
    """The first two objectives of every complete trial; the feasible Pareto front joined up."""
    done = points[points["state"] == "complete"].dropna(subset=["obj_0", "obj_1"])
    fig = go.Figure()
    for name, g, marker in _groups(done):
        if len(g):
            fig.add_trace(go.Scatter(x=g["obj_0"], y=g["obj_1"], mode="markers", name=name, marker=marker,
                                     text=_trial_text(g),
                                     hovertemplate="%{text}<br>%{x:.4g}, %{y:.4g}<extra></extra>"))
    on_front = done[done["number"].isin(front)].sort_values("obj_0")
    if len(on_front):
        fig.add_trace(go.Scatter(x=on_front["obj_0"], y=on_front["obj_1"], mode="lines+markers",
                                 name="Pareto front (meets SLO)",
                                 line={"color": MET, "dash": "dot"}, marker={"color": MET, "size": 13,
                                                                               "symbol": "circle-open"}))
    fig.update_xaxes(title=f"{label(objectives[0])} ({directions[0]})")
    fig.update_yaxes(title=f"{label(objectives[1])} ({directions[1]})")
    return _layout(fig, "Pareto front", height=420)


def goodput_vs_throughput(points: pd.DataFrame) -> go.Figure:
    """Goodput against throughput for every complete trial (single-objective studies)."""
    done = points[points["state"] == "complete"].dropna(subset=["goodput_rps", "output_tokens_per_s"])
    fig = go.Figure()
    for name, g, marker in _groups(done):
        if len(g):
            fig.add_trace(go.Scatter(x=g["output_tokens_per_s"], y=g["goodput_rps"], mode="markers", name=name,
                                     marker=marker, text=_trial_text(g),
                                     hovertemplate="%{text}<br>%{x:.4g} tok/s, %{y:.4g} req/s<extra></extra>"))
    fig.update_xaxes(title=label("output_tokens_per_s"))
    fig.update_yaxes(title=label("goodput_rps"))
    return _layout(fig, "Goodput vs throughput", height=420)


def importance(importances: Mapping[str, float], objective: str) -> go.Figure:
    """Horizontal bars of parameter importance, most important on top."""
    items = sorted(importances.items(), key=lambda kv: kv[1])
    fig = go.Figure(go.Bar(x=[v for _, v in items], y=[k for k, _ in items], orientation="h",
                           marker={"color": PALETTE[0]}))
    fig.update_xaxes(title="importance (share)")
    return _layout(fig, f"Parameter importance for {label(objective)}", height=max(260, 26 * len(items) + 80))


def parallel_coordinates(configs: pd.DataFrame, knobs: Sequence[str], objective: str) -> go.Figure:
    """One line per trial across the knobs that vary, coloured by the objective."""
    dims = []
    for knob in knobs:
        values = configs[knob]
        numeric = pd.to_numeric(values, errors="coerce")
        if numeric.notna().all() and not values.map(lambda v: isinstance(v, bool)).any():
            dims.append({"label": knob.split(".", 1)[-1], "values": numeric.astype(float).tolist()})
        else:
            cats = sorted({str(v) for v in values})
            code = {c: i for i, c in enumerate(cats)}
            dims.append({"label": knob.split(".", 1)[-1], "values": [code[str(v)] for v in values],
                         "tickvals": list(range(len(cats))), "ticktext": cats})
    dims.append({"label": label(objective), "values": configs["value"].astype(float).tolist()})
    fig = go.Figure(go.Parcoords(line={"color": configs["value"].astype(float).tolist(), "colorscale": "Viridis",
                                       "showscale": True}, dimensions=dims, labelangle=-20, labelside="top"))
    return _layout(fig, "Parallel coordinates over the knobs", height=480,
                   margin={"l": 70, "r": 70, "t": 130, "b": 30})


def attainment(points: pd.DataFrame, target: float | None) -> go.Figure:
    """SLO attainment of each complete trial; bars green when the trial met the whole SLO."""
    done = points[points["state"] == "complete"].dropna(subset=["slo_attainment"])
    colours = [MET if f else MISSED for f in done["feasible"]]
    fig = go.Figure(go.Bar(x=done["number"], y=done["slo_attainment"], marker={"color": colours},
                           hovertext=_trial_text(done), hovertemplate="%{hovertext}<br>%{y:.1%}<extra></extra>",
                           name="attainment"))
    if target is not None:
        fig.add_hline(y=target, line={"dash": "dash", "color": "black"}, annotation_text=f"target {target:.0%}")
    fig.update_xaxes(title="trial", type="category")
    fig.update_yaxes(title="share of requests meeting the SLO", range=[0, 1.05], tickformat=".0%")
    return _layout(fig, "SLO attainment per trial")


def cdfs(curves: Mapping[str, pd.DataFrame], metric: str, limit_ms: float | None = None) -> go.Figure:
    """Empirical CDFs (one line per entry of ``curves``) of a per-request latency."""
    fig = go.Figure()
    for i, (name, df) in enumerate(curves.items()):
        if len(df):
            fig.add_trace(go.Scatter(x=df["value"], y=df["fraction"], mode="lines", name=name,
                                     line={"shape": "hv", "color": PALETTE[i % len(PALETTE)]}))
    if limit_ms is not None:
        fig.add_vline(x=limit_ms, line={"dash": "dash", "color": MISSED}, annotation_text=f"SLO {limit_ms:g} ms")
    fig.update_xaxes(title=label(metric))
    fig.update_yaxes(title="share of requests", range=[0, 1.02], tickformat=".0%")
    return _layout(fig, f"{label(metric).split(' (')[0]} CDF", height=320)


def requests_scatter(requests: pd.DataFrame, metric: str, limit_ms: float | None = None) -> go.Figure:
    """Each request at its arrival time against its latency, met or missed."""
    fig = go.Figure()
    groups = (("met SLO", requests["met_slo"] == True, MET),  # noqa: E712 - None means not judged
              ("missed SLO", requests["met_slo"] == False, MISSED),  # noqa: E712
              ("not judged", requests["met_slo"].isna(), BASELINE))
    for name, mask, colour in groups:
        g = requests[mask]
        if len(g):
            fig.add_trace(go.Scatter(x=g["arrival_s"], y=g[metric], mode="markers", name=name,
                                     marker={"color": colour, "size": 7}, text=g["request_id"],
                                     hovertemplate="%{text}<br>arrived %{x:.3f} s<br>%{y:.1f} ms<extra></extra>"))
    if limit_ms is not None:
        fig.add_hline(y=limit_ms, line={"dash": "dash", "color": MISSED}, annotation_text=f"SLO {limit_ms:g} ms")
    fig.update_xaxes(title="arrival (s from start)")
    fig.update_yaxes(title=label(metric))
    return _layout(fig, "Requests over time")


def requests_buckets(buckets: pd.DataFrame) -> go.Figure:
    """Requests arriving per time bucket, stacked met and missed."""
    fig = go.Figure()
    unjudged = buckets["requests"] - buckets["met"] - buckets["missed"]
    for name, y, colour in (("met SLO", buckets["met"], MET), ("missed SLO", buckets["missed"], MISSED),
                            ("not judged", unjudged, BASELINE)):
        if y.sum() > 0:
            fig.add_trace(go.Bar(x=buckets["t_s"], y=y, width=buckets["width_s"], offset=0, name=name,
                                 marker={"color": colour}))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title="arrival (s from start)")
    fig.update_yaxes(title="requests")
    return _layout(fig, "Arrivals per time bucket, met and missed", height=300)


def steps(timeline: pd.DataFrame) -> go.Figure:
    """Batch size, tokens and step time along the run (three stacked panels)."""
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=("batch (sequences)", "tokens per step: prefill (orange), decode (blue)",
                                        "step time (ms)"))
    x = timeline["start_s"]
    fig.add_trace(go.Scatter(x=x, y=timeline["batch_seqs"], mode="lines", line={"shape": "hv"}, name="batch"),
                  row=1, col=1)
    fig.add_trace(go.Bar(x=x, y=timeline["prefill_tokens"], name="prefill tokens", marker={"color": PALETTE[1]}),
                  row=2, col=1)
    fig.add_trace(go.Bar(x=x, y=timeline["decode_tokens"], name="decode tokens", marker={"color": PALETTE[0]}),
                  row=2, col=1)
    fig.add_trace(go.Scatter(x=x, y=timeline["duration_ms"], mode="lines+markers", name="step time",
                             marker={"size": 4}), row=3, col=1)
    if (timeline["steps"] > 1).any():
        fig.add_trace(go.Scatter(x=x, y=timeline["duration_max_ms"], mode="lines", name="slowest step in bucket",
                                 line={"dash": "dot"}), row=3, col=1)
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title="time (s from start)", row=3, col=1)
    return _layout(fig, "Step timeline", height=600, showlegend=False)


def telemetry(readings: pd.DataFrame) -> go.Figure:
    """CPU and GPU utilisation, and memory, along the run."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=("utilisation (%)", "memory"))
    x = readings["t_s"]
    fig.add_trace(go.Scatter(x=x, y=readings["cpu_percent"], mode="lines+markers", name="CPU %"), row=1, col=1)
    if readings["gpu_util_percent"].notna().any():
        fig.add_trace(go.Scatter(x=x, y=readings["gpu_util_percent"], mode="lines+markers", name="GPU %"),
                      row=1, col=1)
    rss = readings["rss_bytes"].astype(float)
    gpu_mem = pd.to_numeric(readings["gpu_mem_bytes"], errors="coerce")
    scale, unit = (2**30, "GiB") if max(rss.max(), gpu_mem.max(skipna=True) or 0) >= 4 * 2**30 else (2**20, "MiB")
    fig.add_trace(go.Scatter(x=x, y=rss / scale, mode="lines+markers", name="process RSS"), row=2, col=1)
    if gpu_mem.notna().any():
        fig.add_trace(go.Scatter(x=x, y=gpu_mem / scale, mode="lines+markers", name="GPU memory"), row=2, col=1)
    fig.layout.annotations[1].text = f"memory ({unit})"
    fig.update_yaxes(rangemode="tozero")
    fig.update_xaxes(title="time (s from start)", row=2, col=1)
    return _layout(fig, "Telemetry", height=460)


def expert_heatmap(stats: pd.DataFrame, field: str) -> go.Figure:
    """One MoE layer per row, one expert per column: tokens, residency, precision or replicas."""
    grid = stats.pivot(index="layer", columns="expert", values=field).sort_index()
    layers = [str(v) for v in grid.index]
    experts = [str(v) for v in grid.columns]
    if field == "precision":
        cats = sorted({str(v) for v in stats["precision"] if v is not None})
        code = {c: i for i, c in enumerate(cats)}
        z = grid.map(lambda v: code.get(str(v), np.nan)).to_numpy(dtype=float)
        colorbar = {"tickvals": list(range(len(cats))), "ticktext": [c or "(none)" for c in cats]}
        text = grid.astype(str).to_numpy()
    elif field == "resident":
        z = grid.astype(float).to_numpy()
        colorbar = {"tickvals": [0, 1], "ticktext": ["host", "resident"]}
        text = np.where(z > 0.5, "resident", "host")
    else:
        z = grid.astype(float).to_numpy()
        colorbar = {}
        text = grid.to_numpy()
    titles = {"tokens": "Tokens routed", "resident": "Resident in the fast tier", "precision": "Precision",
              "replicas": "Replicas"}
    fig = go.Figure(go.Heatmap(z=z, x=experts, y=layers, colorscale="Viridis", colorbar=colorbar, text=text,
                               hovertemplate="layer %{y}, expert %{x}: %{text}<extra></extra>"))
    fig.update_xaxes(title="expert", type="category")
    fig.update_yaxes(title="layer", type="category", autorange="reversed")
    return _layout(fig, f"{titles.get(field, field)} per layer and expert", height=max(240, 22 * len(layers) + 120))


def ep_ranks(tokens_per_rank_per_layer: Sequence[Sequence[int]]) -> go.Figure:
    """Routed pairs each expert-parallel rank computed, per MoE layer (one bar group per layer)."""
    grid = np.asarray(tokens_per_rank_per_layer, dtype=float)
    layers = [str(i) for i in range(grid.shape[0])]
    fig = go.Figure([go.Bar(name=f"rank {r}", x=layers, y=grid[:, r],
                            hovertemplate=f"rank {r}, MoE layer %{{x}}: %{{y:.0f}} pairs<extra></extra>")
                     for r in range(grid.shape[1])])
    fig.update_layout(barmode="group")
    fig.update_xaxes(title="MoE layer", type="category")
    fig.update_yaxes(title="routed pairs")
    return _layout(fig, "Routed pairs per rank and MoE layer")


def arrival_rate(arrivals: pd.DataFrame) -> go.Figure:
    """Arrival rate (requests per second) per time bucket."""
    width = float(arrivals["t_s"].iloc[1] - arrivals["t_s"].iloc[0]) if len(arrivals) > 1 else 1.0
    fig = go.Figure(go.Bar(x=arrivals["t_s"], y=arrivals["rate_per_s"], width=width, offset=0,
                           marker={"color": PALETTE[0]}, customdata=arrivals["requests"],
                           hovertemplate="%{x:.2f} s: %{y:.2f} req/s (%{customdata} requests)<extra></extra>"))
    fig.update_xaxes(title="time (s from start)")
    fig.update_yaxes(title="arrival rate (req/s)")
    return _layout(fig, "Arrival rate over time", height=320)


def length_histogram(hist: pd.DataFrame, what: str) -> go.Figure:
    """Requests per length bin."""
    fig = go.Figure(go.Bar(x=hist["lo"], y=hist["requests"], width=hist["width"], offset=0,
                           marker={"color": PALETTE[1] if what.startswith("output") else PALETTE[0]}))
    fig.update_xaxes(title=f"{what.replace('_', ' ')}")
    fig.update_yaxes(title="requests")
    return _layout(fig, f"{what.split('_')[0].capitalize()} length distribution", height=300)


def popularity(shares: pd.DataFrame, title: str) -> go.Figure:
    """Share of each layer's routed tokens per expert (layer x expert heatmap)."""
    grid = shares.pivot(index="layer", columns="expert", values="share").sort_index()
    fig = go.Figure(go.Heatmap(z=grid.to_numpy(dtype=float), x=[str(v) for v in grid.columns],
                               y=[str(v) for v in grid.index], colorscale="Viridis",
                               hovertemplate="layer %{y}, expert %{x}: %{z:.1%}<extra></extra>"))
    fig.update_xaxes(title="expert", type="category")
    fig.update_yaxes(title="layer", type="category", autorange="reversed")
    return _layout(fig, title, height=max(240, 22 * len(grid) + 120))


def drift(drift_tv: pd.DataFrame, window_tokens: int) -> go.Figure:
    """Per layer, total-variation distance of expert shares between consecutive token windows."""
    fig = go.Figure()
    for i, (layer, g) in enumerate(drift_tv.groupby("layer")):
        fig.add_trace(go.Scatter(x=g["window"], y=g["drift_tv"], mode="lines+markers", name=f"layer {layer}",
                                 line={"color": PALETTE[i % len(PALETTE)]}))
    fig.update_xaxes(title=f"window ({window_tokens} tokens each)")
    fig.update_yaxes(title="TV distance to the previous window", rangemode="tozero")
    return _layout(fig, "Expert popularity drift", height=320)


#: A plan chart's colour per precision of resident experts, and line dash per missing-expert policy.
PRECISION_COLOURS = {"auto": PALETTE[0], "int8": PALETTE[1], "int4": PALETTE[2]}
MISSING_DASHES = {"host": "solid", "fetch": "dash", "auto": "dot"}
ALL_RESIDENT = "all"


def budget_labels(budget_gib: pd.Series) -> list[str]:
    """A plan's budgets as printed: ``36.5``, or ``all`` where every expert is resident (no budget)."""
    return [ALL_RESIDENT if pd.isna(b) else f"{b:.1f}" for b in budget_gib]


def _plan_series(configs: pd.DataFrame) -> list[tuple[str, pd.DataFrame, dict[str, Any]]]:
    """A plan's configs in the series its charts draw: one line per precision x missing-expert policy of the
    coalesced rows without replicas, and marked points for the micro-batch and replica rows."""
    out: list[tuple[str, pd.DataFrame, dict[str, Any]]] = []
    plain = configs[(configs["expert_batching"] != "micro") & (configs["max_replicas"] == 0)]
    for i, ((hi, missing), g) in enumerate(plain.groupby(["hi_precision", plain["missing_expert"].fillna("-")],
                                                         sort=False)):
        colour = PRECISION_COLOURS.get(hi, PALETTE[(3 + i) % len(PALETTE)])
        name = f"{hi} experts, " + ("every expert resident" if missing == "-" else f"missing on {missing}")
        out.append((name, g, {"mode": "lines+markers", "marker": {"color": colour, "size": 9},
                              "line": {"color": colour, "dash": MISSING_DASHES.get(missing, "solid")}}))
    for _, row in configs[configs["expert_batching"] == "micro"].iterrows():
        name = f"micro-batches ({row['hi_precision']}, missing on {row['missing_expert'] or '-'})"
        out.append((name, configs.loc[[row.name]], {"mode": "markers", "marker": {
            "symbol": "square", "size": 13, "color": BASELINE, "line": {"width": 1, "color": "black"}}}))
    for _, row in configs[configs["max_replicas"] > 0].iterrows():
        name = f"{row['max_replicas']} replica(s) ({row['hi_precision']}, missing on {row['missing_expert'] or '-'})"
        out.append((name, configs.loc[[row.name]], {"mode": "markers", "marker": {
            "symbol": "diamond", "size": 13, "color": MET, "line": {"width": 1, "color": "black"}}}))
    return out


def _plan_figure(configs: pd.DataFrame, metric: str, y_title: str, title: str) -> go.Figure:
    priced = configs.dropna(subset=[metric])
    order = sorted({float(b) for b in priced["budget_gib"].dropna()})
    categories = [f"{b:.1f}" for b in order] + ([ALL_RESIDENT] if priced["budget_gib"].isna().any() else [])
    fig = go.Figure()
    for name, g, style in _plan_series(priced):
        g = g.assign(_x=budget_labels(g["budget_gib"]))
        g = g.assign(_rank=[categories.index(x) for x in g["_x"]]).sort_values("_rank")
        fig.add_trace(go.Scatter(x=g["_x"], y=g[metric], name=name, text=[f"config {s + 1}" for s in g["seq"]],
                                 hovertemplate=f"%{{text}}: {name}<br>budget %{{x}} GiB, %{{y:.4g}}<extra></extra>",
                                 **style))
    fig.update_xaxes(title="resident expert budget (GiB; all: every expert resident)", type="category",
                     categoryorder="array", categoryarray=categories)
    fig.update_yaxes(title=y_title, rangemode="tozero")
    # A dozen series: the legend goes beside the plot (under it, it would cover the axis title).
    return _layout(fig, title, height=420, legend={"orientation": "v", "x": 1.02, "y": 1.0, "yanchor": "top"})


def plan_capacity(configs: pd.DataFrame, title: str) -> go.Figure:
    """Capacity at the plan's SLO against resident budget, one line per precision x missing-expert policy."""
    return _plan_figure(configs, "capacity_rps", "capacity at the SLO (req/s)", title)


def plan_throughput(configs: pd.DataFrame, title: str) -> go.Figure:
    """Offline output tokens/s against resident budget, as :func:`plan_capacity`."""
    return _plan_figure(configs, "offline_tokens_per_s", "offline output tokens/s", title)
