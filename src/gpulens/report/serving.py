"""What a report shows for serving runs: ``gpulens serve`` (the server side) and ``gpulens load``
(the client side).

A load run: per tenant its intended and achieved rate, latency percentiles against its SLO,
SLO attainment and goodput, the generator's own lateness, and, from the record's ``requests``
series, latency over time and its distribution per tenant. A serve run: per model its requests,
mean batch size and queue vs compute time, and, from the ``batches`` series, the batch sizes the
dynamic batcher formed over time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from gpulens.report.figures import HISTOGRAM_BINS, LAYOUT, min_max_points


def _ms(value: Any) -> str:
    return "n/a" if value is None else f"{value:,.2f}"


def load_facts(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """One line per tenant, then the generator's lateness and the cost."""
    facts = [("server", str(summary.get("url", "n/a")))]
    tenants = summary.get("tenants") or {}
    for model, t in tenants.items() if isinstance(tenants, dict) else []:
        lat = t.get("latency_ms") or {}
        slo = t.get("slo_ms")
        attain = t.get("slo_attainment")
        facts.append((
            f"{model}",
            f"{t.get('achieved_rate_rps') or 0:,.1f}"
            + (f" of {t['intended_rate_rps']:,.1f}" if t.get("intended_rate_rps") is not None
               else "")  # a closed loop (concurrency) intends no rate
            + " req/s"
            f" · p50/p99/p99.9 {_ms(lat.get('p50'))}/{_ms(lat.get('p99'))}/{_ms(lat.get('p999'))}"
            " ms"
            + (f" · SLO {slo:g} ms met by {100 * attain:.1f}%" if slo and attain is not None
               else "")
            + f" · errors {(t.get('errors') or {}).get('count', 0)}",
        ))  # fmt: skip
    facts.append(("generator lateness p99 ms", _ms(summary.get("loadgen_lateness_ms_p99"))))
    if summary.get("cost_per_1k_requests_usd") is not None:
        facts.append(("cost per 1k requests within SLO",
                      f"${summary['cost_per_1k_requests_usd']:.4f}"))  # fmt: skip
    return facts


def serve_facts(summary: dict[str, Any], effective: dict[str, Any]) -> list[tuple[str, str]]:
    """The server's settings, then one line per model."""
    facts = [
        ("device / precision", f"{effective.get('device', 'n/a')} / "
                               f"{effective.get('precision', 'n/a')}"),
        ("dynamic batching", f"max batch {effective.get('max_batch', 'n/a')}, queue delay "
                             f"{effective.get('max_queue_delay_ms', 'n/a')} ms"
         if effective.get("batching") else "off"),
        ("served s / requests/s", f"{summary.get('served_s', 'n/a')} / "
                                  f"{summary.get('requests_per_s', 'n/a')}"),
    ]  # fmt: skip
    for model, m in (summary.get("models") or {}).items():
        q, c = m.get("queue_ms") or {}, m.get("compute_ms") or {}
        facts.append((
            model,
            f"{m.get('requests', 0):,} requests · mean batch {m.get('mean_batch_size') or 0:.2f}"
            f" · queue p50/p99 {_ms(q.get('p50'))}/{_ms(q.get('p99'))} ms"
            f" · compute p50/p99 {_ms(c.get('p50'))}/{_ms(c.get('p99'))} ms"
            f" · 503s {m.get('rejected_503', 0)}",
        ))  # fmt: skip
    return facts


def latency_percentile_figure(summary: dict[str, Any]) -> go.Figure | None:
    """Latency p50/p90/p99/p99.9 per tenant, with each tenant's SLO marked."""
    tenants = summary.get("tenants") or {}
    if not isinstance(tenants, dict) or not tenants:
        return None
    fig = go.Figure()
    for key, label in (("p50", "p50"), ("p90", "p90"), ("p99", "p99"), ("p999", "p99.9")):
        fig.add_trace(go.Bar(
            x=list(tenants), y=[(t.get("latency_ms") or {}).get(key) for t in tenants.values()],
            name=label,
        ))  # fmt: skip
    slos = [t.get("slo_ms") for t in tenants.values()]
    if any(slos):
        fig.add_trace(go.Scatter(x=list(tenants), y=slos, mode="markers", name="SLO",
                                 marker={"symbol": "line-ew-open", "size": 40,
                                         "line": {"width": 3}}))  # fmt: skip
    fig.update_layout(title="latency per tenant (from each request's scheduled time)",
                      barmode="group", yaxis_title="ms", height=400, **LAYOUT)  # fmt: skip
    return fig


def _by_tenant(rows: pd.DataFrame):
    """(label, rows) per tenant, and per trial where the run held several (a --find-max or
    --sweep: each trial at its own rate, its clock from 0; pooled, they read as one rate)."""
    trials = "trial" in rows and rows["trial"].nunique() > 1
    for key, part in rows.groupby(["model", "trial"] if trials else "model", sort=False):
        yield (f"{key[0]} · trial {key[1]}" if trials else str(key)), part


def latency_over_time_figure(requests: pd.DataFrame) -> go.Figure | None:
    """Each measured request's latency against when it was due, per tenant (errors apart)."""
    if requests is None or requests.empty or "latency_ms" not in requests:
        return None
    measured = requests[requests["measured"].astype(bool)]
    if measured.empty:
        return None
    fig = go.Figure()
    for model, rows in _by_tenant(measured):
        ok = rows[(rows["status"] >= 200) & (rows["status"] < 300)]
        x, y = min_max_points(ok["scheduled_s"].reset_index(drop=True),
                              ok["latency_ms"].reset_index(drop=True))  # fmt: skip
        fig.add_trace(go.Scattergl(x=x, y=y, mode="markers", marker={"size": 3},
                                   name=f"{model}"))  # fmt: skip
        failed = rows[(rows["status"] < 200) | (rows["status"] >= 300)]
        if not failed.empty:
            fig.add_trace(go.Scattergl(
                x=failed["scheduled_s"], y=np.zeros(len(failed)), mode="markers",
                marker={"symbol": "x", "size": 6}, name=f"{model} errors",
            ))  # fmt: skip
    fig.update_layout(title="latency over time", xaxis_title="s since start (due time)",
                      yaxis_title="ms", height=400, **LAYOUT)  # fmt: skip
    return fig


def latency_cdf_figure(requests: pd.DataFrame) -> go.Figure | None:
    """The latency distribution per tenant (successful measured requests), as a CDF."""
    if requests is None or requests.empty or "latency_ms" not in requests:
        return None
    ok = requests[requests["measured"].astype(bool) & (requests["status"] >= 200)
                  & (requests["status"] < 300)]  # fmt: skip
    if ok.empty:
        return None
    fig = go.Figure()
    for model, rows in _by_tenant(ok):
        values = np.sort(rows["latency_ms"].dropna().to_numpy())
        if values.size == 0:
            continue
        # at most ~2000 points per curve: quantiles, not every request
        qs = np.linspace(0, 1, min(values.size, 2000))
        fig.add_trace(go.Scatter(x=np.quantile(values, qs), y=qs, mode="lines", name=model))
    fig.update_layout(title="latency distribution (CDF)", xaxis_title="ms", xaxis_type="log",
                      yaxis_title="share of requests", height=380, **LAYOUT)  # fmt: skip
    return fig


def batch_size_figure(batches: pd.DataFrame) -> go.Figure | None:
    """How often each batch size ran, per model (what dynamic batching formed)."""
    if batches is None or batches.empty or "batch_size" not in batches:
        return None
    fig = go.Figure()
    for model, rows in batches.groupby("model", sort=False):
        fig.add_trace(go.Histogram(x=rows["batch_size"], name=model, nbinsx=HISTOGRAM_BINS))
    fig.update_layout(title="batch sizes executed", xaxis_title="samples per execution",
                      yaxis_title="executions", barmode="overlay", height=360,
                      **LAYOUT)  # fmt: skip
    fig.update_traces(opacity=0.7)
    return fig
