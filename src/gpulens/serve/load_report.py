"""The numbers of a load run, from its request records: pure analysis, no I/O.

- Latency runs from each request's SCHEDULED arrival to its completion (as LoadGen's server
  scenario), so time a request waited in the generator or in the server's queue counts.
- Percentiles are over the requests that succeeded; SLO attainment is over every measured
  request, an error or a timeout counting as a miss; goodput is requests within the SLO per
  second of the measured window (without an SLO, every successful request counts).
- Warm-up requests (scheduled before ``warmup_s``) are excluded from everything.
- The server-side split comes from two scrapes of the server's Prometheus ``/metrics`` with
  Triton's metric names (``gpulens serve`` uses the same).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

ERR_TIMEOUT = -1
ERR_CONNECTION = -2
ERR_OTHER = -3
NOT_DONE = 0  # still in flight when the run ended: counted as a timeout
ERROR_KINDS = {ERR_TIMEOUT: "timeout", ERR_CONNECTION: "connection", ERR_OTHER: "other",
               NOT_DONE: "timeout"}  # fmt: skip
LATENESS_LIMIT_MS = 1.0
ACHIEVED_MIN_FRACTION = 0.98
PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p999": 99.9}

TRITON_METRICS = {
    "requests": "nv_inference_request_success",
    "queue_us": "nv_inference_queue_duration_us",
    "compute_us": "nv_inference_compute_infer_duration_us",
    "compute_input_us": "nv_inference_compute_input_duration_us",
    "compute_output_us": "nv_inference_compute_output_duration_us",
    "executions": "nv_inference_exec_count",
    "inferences": "nv_inference_count",
}


@dataclass
class LoadRecords:
    """One entry per scheduled request, times in seconds from the run's start. ``status``: the
    HTTP status, or one of the negative ``ERR_*`` codes, or ``NOT_DONE``. ``ttft_s``/``tpot_s``
    only for streamed (OpenAI) requests, NaN elsewhere."""

    tenant: np.ndarray
    scheduled_s: np.ndarray
    sent_s: np.ndarray
    done_s: np.ndarray
    status: np.ndarray
    warmup_s: float
    duration_s: float
    ttft_s: np.ndarray | None = None
    tpot_s: np.ndarray | None = None

    def measured(self) -> np.ndarray:
        lo, hi = self.warmup_s, self.warmup_s + self.duration_s
        return (self.scheduled_s >= lo) & (self.scheduled_s < hi)

    def ok(self) -> np.ndarray:
        return (self.status >= 200) & (self.status < 300)

    @property
    def latency_s(self) -> np.ndarray:
        return self.done_s - self.scheduled_s


def requests_frame(rec: LoadRecords, models: list[str], trial: int = 0) -> pd.DataFrame:
    """One row per scheduled request, for the run record's ``requests`` series: tenant, when
    it was due and sent, latency (from its scheduled time) and status; NaN where not done."""
    frame = pd.DataFrame({
        "trial": np.full(rec.tenant.shape, trial, dtype=np.int32),
        "model": np.asarray(models, dtype=object)[rec.tenant.astype(int)],
        "scheduled_s": rec.scheduled_s,
        "lateness_ms": (rec.sent_s - rec.scheduled_s) * 1000.0,
        "latency_ms": rec.latency_s * 1000.0,
        "status": rec.status.astype(np.int32),
        "measured": rec.measured(),
    })  # fmt: skip
    if rec.ttft_s is not None:
        frame["ttft_ms"] = rec.ttft_s * 1000.0
    if rec.tpot_s is not None:
        frame["tpot_ms"] = rec.tpot_s * 1000.0
    return frame


def percentiles_ms(values_s: np.ndarray, which: dict[str, float] = PERCENTILES) -> dict:
    """``{"p50": ms, ...}``; None for each without values."""
    v = np.asarray(values_s, dtype=float)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {k: None for k in which}
    qs = np.percentile(v * 1000.0, list(which.values()))
    return {k: round(float(q), 4) for k, q in zip(which, qs, strict=True)}


def error_counts(status: np.ndarray) -> dict:
    """``{"count": N, "by_kind": {"http_500": n, "timeout": n, "connection": n}}``."""
    by_kind: dict[str, int] = {}
    for code in status[(status < 200) | (status >= 300)]:
        kind = f"http_{int(code)}" if code >= 100 else ERROR_KINDS.get(int(code), "other")
        by_kind[kind] = by_kind.get(kind, 0) + 1
    return {"count": int(sum(by_kind.values())), "by_kind": dict(sorted(by_kind.items()))}


def tenant_report(
    rec: LoadRecords, index: int, model: str, rate_rps: float, slo_ms: float | None,
    batch: int = 1,
) -> dict:  # fmt: skip
    """One tenant's entry of the JSON document."""
    mine = rec.measured() & (rec.tenant == index)
    ok = mine & rec.ok()
    n, n_ok = int(mine.sum()), int(ok.sum())
    window = rec.duration_s
    latency = rec.latency_s[ok]
    within = n_ok if slo_ms is None else int((latency * 1000.0 <= slo_ms).sum())
    doc = {
        "model": model,
        "intended_rate_rps": rate_rps,
        "scheduled_rate_rps": round(n / window, 4),
        "achieved_rate_rps": round(n_ok / window, 4),
        "requests": n,
        "latency_ms": percentiles_ms(latency),
        "slo_ms": slo_ms,
        "slo_attainment": round(within / n, 6) if (slo_ms is not None and n) else None,
        "goodput_rps": round(within / window, 4),
        "errors": error_counts(rec.status[mine]),
        "batch": batch,
    }
    if rec.ttft_s is not None and np.isfinite(rec.ttft_s[ok]).any():
        pick = {"p50": 50.0, "p99": 99.0}
        doc["ttft_ms"] = percentiles_ms(rec.ttft_s[ok], pick)
        doc["tpot_ms"] = percentiles_ms(rec.tpot_s[ok], pick) if rec.tpot_s is not None else None
    return doc


def lateness(rec: LoadRecords) -> dict:
    """The generator's own lateness (send − scheduled) over the measured requests sent."""
    m = rec.measured() & np.isfinite(rec.sent_s)
    late = rec.sent_s[m] - rec.scheduled_s[m]
    pct = percentiles_ms(late, {"p50": 50.0, "p99": 99.0})
    pct["max"] = round(float(late.max() * 1000.0), 4) if late.size else None
    return pct


def late_note(late: dict, scenario: str | None = None) -> bool:
    """Whether the generator's lateness says it, not the server, was the limit (never in the
    offline scenario, where every request is due at once)."""
    p99 = late.get("p99")
    return scenario != "offline" and p99 is not None and p99 > LATENESS_LIMIT_MS


def generator_notes(tenants: Sequence[dict], late: dict, scenario: str | None = None) -> list[str]:
    """Why the generator, not the server, may have been the limit (empty when it was not).
    In the offline scenario every request is due at once, so lateness there is only the time
    the sends took, never a fault of the schedule: no note about it."""
    notes = []
    if late_note(late, scenario):
        notes.append(
            f"the load generator sent requests late (lateness p99 {late['p99']:.2f} ms > "
            f"{LATENESS_LIMIT_MS:g} ms): latencies include its delay; lower the rate or use "
            "another process/machine for load"
        )
    for t in tenants:
        if not t.get("requests"):  # its numbers are all empty: say why, not only "-"
            notes.append(
                f"{t['model']}: no request was due in the measured window (too few at rate x "
                "--duration): raise --duration or the rate"
            )
        sched = t.get("scheduled_rate_rps") or 0.0
        if sched and t["achieved_rate_rps"] < ACHIEVED_MIN_FRACTION * sched:
            notes.append(
                f"{t['model']}: achieved {t['achieved_rate_rps']:.1f} of {sched:.1f} requests/s "
                f"scheduled (< {ACHIEVED_MIN_FRACTION:.0%}): server errors/timeouts "
                f"({t['errors']['count']}) or a generator that could not keep up"
            )
    return notes


def cost_per_1k_requests(price_per_hour_usd: float | None, goodput_rps: float) -> float | None:
    """USD per 1,000 requests within the SLO; None without a price or without goodput."""
    if price_per_hour_usd is None or not goodput_rps > 0:
        return None
    return round(price_per_hour_usd / (3600.0 * goodput_rps) * 1000.0, 6)


# --------------------------------------------------------------------------- Prometheus
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text exposition: (name, labels, value); comments skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        samples.append((m.group(1), labels, value))
    return samples


def model_totals(text: str, model: str) -> dict[str, float]:
    """Triton's counters for ``model``, summed over versions (and GPUs); absent ones left out."""
    by_name = {v: k for k, v in TRITON_METRICS.items()}
    totals: dict[str, float] = {}
    for name, labels, value in parse_prometheus(text):
        if name in by_name and labels.get("model") == model:
            key = by_name[name]
            totals[key] = totals.get(key, 0.0) + value
    return totals


def server_split(before: str, after: str, models: Sequence[str]) -> dict:
    """Per model, from the deltas of two scrapes: requests, mean queue and compute ms per
    request, mean batch size (inferences per execution)."""
    out: dict[str, dict] = {}
    for model in models:
        a, b = model_totals(before, model), model_totals(after, model)
        if "requests" not in b:
            out[model] = {"reason": f"no {TRITON_METRICS['requests']} series for this model"}
            continue
        d = {k: b[k] - a.get(k, 0.0) for k in b}
        n = d["requests"]
        entry: dict = {"requests": int(n)}
        for key, label in (("queue_us", "queue"), ("compute_us", "compute"),
                           ("compute_input_us", "compute_input"),
                           ("compute_output_us", "compute_output")):  # fmt: skip
            if key in d:
                entry[f"mean_{label}_ms"] = round(d[key] / n / 1000.0, 4) if n > 0 else None
        if "executions" in d and "inferences" in d:
            ex = d["executions"]
            entry["mean_batch_size"] = round(d["inferences"] / ex, 3) if ex > 0 else None
        out[model] = entry
    return {"source": "prometheus /metrics (Triton metric names)", "models": out}


# --------------------------------------------------------------------------- the document
def scenario_result(scenario: str | None, tenants: list[dict], rec: LoadRecords) -> dict | None:
    """The figure LoadGen reports for a scenario (see gpulens.serve.loadgen)."""
    if scenario is None:
        return None
    if scenario == "single-stream":
        return {"scenario": scenario, "metric": "p90_latency_ms",
                "value": tenants[0]["latency_ms"]["p90"]}  # fmt: skip
    if scenario == "server":
        ok = all(
            t["latency_ms"]["p99"] is not None and t["latency_ms"]["p99"] <= t["slo_ms"]
            for t in tenants
        )
        return {"scenario": scenario, "metric": "p99_latency_within_slo", "valid": ok}
    ok = rec.ok()
    if not ok.any():
        return {"scenario": scenario, "metric": "samples_per_s", "value": None}
    span = float(rec.done_s[ok].max() - rec.scheduled_s.min())
    samples = int(ok.sum()) * int(tenants[0].get("batch", 1))
    value = round(samples / span, 3) if span > 0 else None
    return {"scenario": scenario, "metric": "samples_per_s", "value": value, "samples": samples}


def build_document(
    url: str,
    tenant_specs: Sequence,
    rec: LoadRecords,
    server: dict | None,
    price_per_hour_usd: float | None = None,
    scenario: str | None = None,
    server_reason: str | None = None,
    concurrency: int | None = None,
) -> dict:
    """The ``gpulens load --json`` document (keys: DESIGN.md output contracts). With
    ``concurrency`` or the single-stream scenario (closed loops) no rate was intended:
    ``intended_rate_rps`` is None."""
    closed = concurrency is not None or scenario == "single-stream"  # no rate is intended
    tenants = [
        tenant_report(rec, i, t.model, None if closed else t.rate_rps, t.slo_ms, t.batch)
        for i, t in enumerate(tenant_specs)
    ]
    late = lateness(rec)
    notes = generator_notes(tenants, late, scenario)
    goodput = sum(t["goodput_rps"] for t in tenants)
    doc = {
        "url": url,
        "duration_s": rec.duration_s,
        "warmup_s": rec.warmup_s,
        "tenants": tenants,
        "loadgen_lateness_ms_p99": late["p99"],
        "loadgen_lateness_ms": late,
        # the generator was the limit when it sent late; a server's errors are no such sign
        "generator_limited": late_note(late, scenario),
        "generator_notes": notes,
        "server": server,
        "total_goodput_rps": round(goodput, 4),
        "price_per_hour_usd": price_per_hour_usd,
        "cost_per_1k_requests_usd": cost_per_1k_requests(price_per_hour_usd, goodput),
    }
    if server is None:
        doc["server_reason"] = server_reason or "no /metrics on the server"
    if scenario is not None:
        doc["scenario"] = scenario_result(scenario, tenants, rec)
    if concurrency is not None:
        doc["concurrency"] = concurrency
    return _finite(doc)


def _finite(obj):
    """NaN and infinities are not JSON: None in their place."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
