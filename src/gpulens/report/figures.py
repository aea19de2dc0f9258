"""Plotly figures of runs and experiments, built from what the records hold.

Each builder takes data (series DataFrames, a summary, a breakdown, a colocate document) and
returns a ``plotly.graph_objects.Figure``, or None when the data has nothing to draw. The HTML
report uses them, and the dashboard will; nothing here reads files or prints.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from gpulens.colocate.metrics import throughput_units

# Above this many points a line is drawn with WebGL, and step bars are averaged into bins.
WEBGL_POINTS = 5000
MAX_STEP_BARS = 600
# A line of more samples than this is drawn from the lowest and highest sample of each bin.
MAX_LINE_POINTS = 4000
HISTOGRAM_BINS = 80

PHASE_COLORS = {"data_wait": "#e4572e", "h2d": "#f3a712", "compute": "#29335c"}
STALL_COLORS = {"compute": "#29335c", "prep_stall": "#e4572e", "fetch_stall": "#f3a712",
                "communication": "#669bbc"}  # fmt: skip
ACTIVITY = (
    ("gpu_util_pct", "GPU utilization (any kernel running)"),
    ("sm_activity_pct", "SM activity"),
    ("tensor_activity_pct", "tensor-core activity"),
    ("dram_bw_util_pct", "DRAM bandwidth"),
)
LAYOUT = {"template": "plotly_white", "margin": {"l": 60, "r": 20, "t": 50, "b": 40}}


def min_max_points(x: pd.Series, y: pd.Series, max_points: int = MAX_LINE_POINTS):
    """At most ``max_points`` points of a line for display: in each of ``max_points / 2`` bins
    of consecutive samples, its lowest and highest sample in time order, so that peaks and dips
    survive (a mean would flatten them). Shorter lines are returned whole."""
    x, y = x.reset_index(drop=True), y.reset_index(drop=True)
    if len(y) <= max_points:
        return x, y
    valid = y.notna()
    bins = pd.Series(np.arange(len(y)) * (max_points // 2) // len(y))[valid]
    yv = y[valid]
    keep = np.union1d(yv.groupby(bins).idxmin().to_numpy(), yv.groupby(bins).idxmax().to_numpy())
    return x[keep], y[keep]


def _line(x, y, name: str, **kw: Any) -> go.Scatter | go.Scattergl:
    x, y = min_max_points(x, y)
    trace = go.Scattergl if len(x) > WEBGL_POINTS else go.Scatter
    return trace(x=x, y=y, name=name, mode="lines", **kw)


def _has(df: pd.DataFrame | None, column: str) -> bool:
    return df is not None and column in df and df[column].notna().any()


def step_phases(steps: pd.DataFrame, t0_unix_s: float) -> pd.DataFrame:
    """Measured steps as (t_s, data_wait_ms, h2d_ms, compute_ms, step_ms), averaged into at most
    MAX_STEP_BARS bins of consecutive steps so that an hour of steps stays drawable."""
    measured = steps[~steps["warmup"].astype(bool)] if "warmup" in steps else steps
    if measured.empty:
        return pd.DataFrame(columns=["t_s", "width_s", "data_wait_ms", "h2d_ms", "compute_ms",
                                     "step_ms"])  # fmt: skip
    out = pd.DataFrame(
        {
            # Each bar spans its step: centred on it, as wide as it lasted.
            "t_s": measured["time_unix_s"] - t0_unix_s - measured["step_time_s"] / 2,
            "width_s": measured["step_time_s"],
            "data_wait_ms": 1000 * measured["data_wait_s"],
            "h2d_ms": 1000 * measured["h2d_s"],
            "compute_ms": 1000 * measured["compute_s"],
            "step_ms": 1000 * measured["step_time_s"],
        }
    ).reset_index(drop=True)
    if len(out) > MAX_STEP_BARS:
        bins = (out.index.to_series() * MAX_STEP_BARS // len(out)).to_numpy()
        grouped = out.groupby(bins)
        width = grouped["width_s"].sum()
        out = grouped.mean()
        out["t_s"] = grouped["t_s"].first() - grouped["width_s"].first() / 2 + width / 2
        out["width_s"] = width
    return out


def timeline_figure(
    gpu: pd.DataFrame | None,
    steps: pd.DataFrame | None,
    title: str,
    gpu_index: int | None = None,
    t0_unix_s: float | None = None,
) -> go.Figure | None:
    """GPU activity, memory, power and SM clock over time, with each step's phases (data wait,
    copy, compute) in a row beneath on the same time axis. ``t0_unix_s``: the time origin
    (default: the first sample or step drawn), so that one run's figures share one axis."""
    if gpu is not None and not gpu.empty and gpu_index is None and "gpu_index" in gpu:
        gpu_index = int(gpu["gpu_index"].iloc[0])
    if gpu is not None and gpu_index is not None and "gpu_index" in gpu:
        gpu = gpu[gpu["gpu_index"] == gpu_index]
    has_gpu = gpu is not None and not gpu.empty
    # warm-up steps alone (a command stopped before its first measured step) draw no bars
    has_steps = steps is not None and not step_phases(steps, 0.0).empty
    if not has_gpu and not has_steps:
        return None
    starts = []
    if has_gpu:
        starts.append(float(gpu["time_unix_s"].min()))
    if has_steps:
        starts.append(float((steps["time_unix_s"] - steps["step_time_s"]).min()))
    t0 = min(starts) if t0_unix_s is None else t0_unix_s
    rows = (["activity %", "memory GiB", "power W", "SM clock MHz"] if has_gpu else []) + (
        ["step ms"] if has_steps else []
    )
    fig = make_subplots(rows=len(rows), cols=1, shared_xaxes=True, vertical_spacing=0.04)
    row = 1
    if has_gpu:
        t = gpu["time_unix_s"] - t0
        for column, label in ACTIVITY:
            if _has(gpu, column):
                fig.add_trace(_line(t, gpu[column], label, legendgroup="activity"), row=row, col=1)
        row += 1
        if _has(gpu, "mem_used_bytes"):
            fig.add_trace(_line(t, gpu["mem_used_bytes"] / 2**30, "memory used"), row=row, col=1)
        row += 1
        if _has(gpu, "power_w"):
            fig.add_trace(_line(t, gpu["power_w"], "power"), row=row, col=1)
        row += 1
        if _has(gpu, "sm_clock_mhz"):
            fig.add_trace(_line(t, gpu["sm_clock_mhz"], "SM clock"), row=row, col=1)
        row += 1
    if has_steps:
        phases = step_phases(steps, t0)
        for phase, color in PHASE_COLORS.items():
            fig.add_trace(
                go.Bar(x=phases["t_s"], y=phases[f"{phase}_ms"], width=phases["width_s"],
                       name=phase.replace("_", " "), marker_color=color, marker_line_width=0,
                       legendgroup="phases"),
                row=row, col=1,
            )  # fmt: skip
        fig.update_layout(barmode="stack", bargap=0)
    for i, label in enumerate(rows, start=1):
        fig.update_yaxes(title_text=label, row=i, col=1)
    if has_gpu:
        fig.update_yaxes(range=[0, 105], row=1, col=1)
    fig.update_xaxes(title_text="seconds from start", row=len(rows), col=1)
    fig.update_layout(title=title, height=170 * len(rows) + 120, hovermode="x unified", **LAYOUT)
    return fig


def step_time_figure(step_times_ms: dict[str, pd.Series]) -> go.Figure | None:
    """Distribution of measured step times, one histogram per run (overlaid)."""
    series = {name: s.dropna() for name, s in step_times_ms.items() if s is not None}
    series = {name: s for name, s in series.items() if not s.empty}
    if not series:
        return None
    # Counted here, on shared bins, not in the browser: an hour of steps is 10^5-10^6 values.
    low = min(float(s.min()) for s in series.values())
    high = max(float(s.quantile(0.999)) for s in series.values())
    edges = np.linspace(low, high if high > low else low + 1.0, HISTOGRAM_BINS + 1)
    centers, width = (edges[:-1] + edges[1:]) / 2, edges[1] - edges[0]
    fig = go.Figure()
    for name, s in series.items():
        counts, _ = np.histogram(s.clip(upper=edges[-1]), bins=edges)
        fig.add_trace(go.Bar(x=centers, y=counts, width=width, name=name, marker_line_width=0,
                             opacity=0.65 if len(series) > 1 else 1.0))  # fmt: skip
    fig.update_layout(
        title="step time distribution (measured steps; the slowest 0.1% in the last bin)",
        barmode="overlay", xaxis_title="step time ms", yaxis_title="steps", height=360,
        bargap=0, **LAYOUT,
    )  # fmt: skip
    return fig


def stall_figure(breakdowns: dict[str, dict[str, Any]]) -> go.Figure | None:
    """Where the time goes, one stacked bar per breakdown: compute and each stall in percent of
    the step, each with its 95% interval as a whisker at the end of its segment."""
    usable = {k: b for k, b in breakdowns.items() if b.get("breakdown_pct")}
    if not usable:
        return None
    fig = go.Figure()
    parts: list[str] = []
    for b in usable.values():
        parts += [p for p, v in b["breakdown_pct"].items() if v is not None and p not in parts]
    names = list(usable)
    for part in parts:
        shares = [usable[n]["breakdown_pct"].get(part) for n in names]
        cis = [(usable[n].get("breakdown_ci95_pp") or {}).get(part) for n in names]
        fig.add_trace(
            go.Bar(
                y=names, x=shares, orientation="h", name=part.replace("_", " "),
                marker_color=STALL_COLORS.get(part),
                error_x={"type": "data", "array": [c or 0 for c in cis], "visible": True},
                text=[f"{s:.1f}%" if s is not None else "" for s in shares],
                textposition="inside",
            )
        )  # fmt: skip
    fig.update_layout(
        title="stall breakdown (share of the step, 95% intervals)", barmode="stack",
        xaxis={"title": "% of step time", "range": [0, 105]},
        height=200 + 60 * len(names), **LAYOUT,
    )  # fmt: skip
    return fig


def what_if_figure(what_if: dict[str, Any]) -> go.Figure | None:
    """The stall model's predictions: samples/s against loader workers and against the share of
    the dataset in the page cache (the measured setting is one point on each curve)."""
    titles = {"workers": "loader workers", "page_cache_pct": "% of the data in the page cache"}
    curves = [(key, title) for key, title in titles.items() if what_if.get(key)]
    if not curves:
        return None
    fig = make_subplots(rows=1, cols=len(curves), subplot_titles=[t for _, t in curves])
    for col, (key, title) in enumerate(curves, start=1):
        points = sorted((float(x), float(y)) for x, y in what_if[key].items() if y is not None)
        fig.add_trace(
            go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="lines+markers",
                       name=title, showlegend=False),
            row=1, col=col,
        )  # fmt: skip
        fig.update_xaxes(title_text=title, row=1, col=col)
        fig.update_yaxes(title_text="samples/s (predicted)", row=1, col=col, rangemode="tozero")
    fig.update_layout(title="what if (the stall model's predictions)", height=320, **LAYOUT)
    return fig


def setting_label(result: dict[str, Any]) -> str:
    setting = result.get("setting")
    return result["mechanism"] + (f" {setting}" if setting not in (None, "", "default") else "")


def colocate_figures(doc: dict[str, Any]) -> list[go.Figure]:
    """Throughput alone vs together per job and mechanism, the slowdown heat map (job x
    mechanism), and combined throughput with fairness."""
    # a mechanism that did not run (unavailable, did not fit, failed) gets no empty column:
    # the report says why in a note
    results = [
        r for r in doc.get("results") or []
        if any(j.get("throughput_together") is not None for j in r.get("jobs") or [])
    ]  # fmt: skip
    if not results:
        return []
    labels = [setting_label(r) for r in results]
    jobs = [j["name"] for j in doc.get("jobs") or []] or [j["name"] for j in results[0]["jobs"]]
    by = {(lab, j["name"]): j for lab, r in zip(labels, results, strict=True) for j in r["jobs"]}
    alone = {j["name"]: j.get("throughput_alone") for j in doc.get("jobs") or []}
    # each job in its own unit (training samples/s, inference requests/s, a command runs/s)
    units = throughput_units(doc)
    one_unit = units.get(jobs[0]) if len({units.get(job) for job in jobs}) == 1 else None
    bars = go.Figure()
    for job in jobs:
        unit = units.get(job) or "per s"
        bars.add_trace(go.Bar(
            x=labels, y=[(by.get((lab, job)) or {}).get("throughput_together") for lab in labels],
            name=f"{job} together ({unit})",
            hovertemplate=f"%{{y:,.2f}} {unit}",
        ))  # fmt: skip
        if alone.get(job):
            bars.add_trace(go.Scatter(
                x=labels, y=[alone[job]] * len(labels), mode="lines+markers",
                line={"dash": "dot"}, name=f"{job} alone ({unit})",
                hovertemplate=f"%{{y:,.2f}} {unit}",
            ))  # fmt: skip
    bars.update_layout(title="throughput alone and together", barmode="group",
                       yaxis_title=one_unit or "throughput (each job's unit in the legend)",
                       height=420, **LAYOUT)  # fmt: skip
    z = [[(by.get((lab, job)) or {}).get("slowdown") for lab in labels] for job in jobs]
    heat = go.Figure(go.Heatmap(
        z=z, x=labels, y=jobs, colorscale="Reds", zmin=1.0, colorbar={"title": "slowdown x"},
        text=[[f"{v:.2f}x" if v else "" for v in row] for row in z], texttemplate="%{text}",
    ))  # fmt: skip
    heat.update_layout(title="slowdown together vs alone (job x mechanism)",
                       height=160 + 50 * len(jobs), **LAYOUT)  # fmt: skip
    combined = make_subplots(specs=[[{"secondary_y": True}]])
    combined.add_trace(go.Bar(
        x=labels, y=[r.get("normalized_aggregate_throughput") for r in results],
        name="normalized aggregate throughput",
    ))  # fmt: skip
    combined.add_trace(go.Scatter(
        x=labels, y=[r.get("jain_fairness") for r in results], mode="markers+lines",
        name="Jain fairness",
    ), secondary_y=True)  # fmt: skip
    combined.update_layout(title="combined throughput (1 = one job alone) and fairness",
                           height=380, **LAYOUT)  # fmt: skip
    combined.update_yaxes(title_text="sum of together/alone", secondary_y=False)
    combined.update_yaxes(title_text="fairness", range=[0, 1.05], secondary_y=True)
    return [bars, heat, combined]


def prep_figure(prep: pd.DataFrame | None, title: str) -> go.Figure | None:
    """Mean time per sample in each loader stage (read, decode, augment), per worker."""
    if prep is None or prep.empty or "worker_id" not in prep:
        return None
    stages = [c for c in ("read_s", "decode_s", "augment_s") if _has(prep, c)]
    if not stages:
        return None
    per_worker = prep.groupby("worker_id")[stages].mean() * 1000
    fig = go.Figure()
    for stage in stages:
        fig.add_trace(go.Bar(x=[f"worker {int(w)}" for w in per_worker.index],
                             y=per_worker[stage], name=stage.removesuffix("_s")))  # fmt: skip
    fig.update_layout(title=title, barmode="stack", yaxis_title="ms per sample", height=380,
                      **LAYOUT)  # fmt: skip
    return fig
