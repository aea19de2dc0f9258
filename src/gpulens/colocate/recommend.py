"""Which mechanism to use: the best result within a slowdown limit, and one line that says why."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------ recommendation
def _slows(s: float | None) -> str:
    """``slows 35%`` (the speed a job loses together); ``slows 0%`` when that rounds to zero;
    ``speeds up 5%`` when the job ran faster together than alone."""
    if not s or s == float("inf"):
        return "slows all"
    lost_pct = 100 * (1 - 1 / s)
    if round(lost_pct) < 0:
        return f"speeds up {100 * (1 / s - 1):.0f}%"
    return f"slows {max(lost_pct, 0.0):.0f}%"


def best_result(results: list[dict[str, Any]], max_slowdown: float | None) -> dict | None:
    """The measured result with the highest normalized aggregate throughput whose jobs all stay
    within ``max_slowdown``."""
    ok = []
    for r in results:
        agg = r.get("normalized_aggregate_throughput")
        if r.get("status") != "ok" or agg is None:
            continue
        worst = max((j["slowdown"] or 0) for j in r["jobs"])
        if max_slowdown is not None and worst > max_slowdown:
            continue
        ok.append(r)
    return max(ok, key=lambda r: r["normalized_aggregate_throughput"], default=None)


def recommend(doc: dict[str, Any], max_slowdown: float | None = None) -> str:
    """One sentence from the results."""
    results = doc["results"]
    names = [j["name"] for j in doc["jobs"]]
    who = " and ".join(names) if len(names) <= 2 else ", ".join(names[:-1]) + f" and {names[-1]}"
    best = best_result(results, max_slowdown)
    cap = f" within the {max_slowdown:g}x slowdown cap" if max_slowdown else ""
    if best is None:
        measured = [r for r in results if r.get("status") == "ok"]
        if not measured:
            return f"no mechanism ran {who} together successfully: run them on separate GPUs"
        return f"run {who} on separate GPUs or one after another: no mechanism kept every job{cap}"
    agg = best["normalized_aggregate_throughput"]
    label = result_label(best)
    if agg <= 1.0:
        return (
            f"run {who} one after another or on separate GPUs: the best mechanism ({label}) "
            f"gives only {agg:.2f}x combined throughput"
        )
    worst = max(best["jobs"], key=lambda j: j["slowdown"] or 0)
    text = (
        f"run {who} together under {label}: {agg:.2f}x combined throughput, "
        f"{worst['name']} {_slows(worst['slowdown'])}"
    )
    infer = [j for j in best["jobs"] if j.get("kind") == "infer"]
    for j in infer[:1]:
        if j.get("step_time_p99_alone_s") and j.get("step_time_p99_s"):
            text += (
                f"; {j['name']} p99 latency {1000 * j['step_time_p99_alone_s']:.1f} ms alone, "
                f"{1000 * j['step_time_p99_s']:.1f} ms together"
            )
    for j in infer:
        if j.get("slo_attainment") is not None and j.get("slo_attainment_alone") is not None:
            text += (
                f"; {j['name']} within {j['slo_ms']:g} ms: {100 * j['slo_attainment_alone']:.1f}%"
                f" alone, {100 * j['slo_attainment']:.1f}% together"
            )
    return text + _energy(best)


def _energy(result: dict[str, Any]) -> str:
    """The GPU energy the jobs' work took together against each job alone: the one energy
    figure that compares mechanisms whatever the jobs count (per sample, request or run)."""
    ratio = result.get("energy_vs_alone_ratio")
    if ratio is None:
        return ""
    change = 100 * (1 - ratio)
    if round(change) == 0:
        return "; the same GPU energy for the work as each job alone"
    more_less = "less" if change > 0 else "more"
    return f"; {abs(change):.0f}% {more_less} GPU energy for the work than each job alone"


def experiment_status(doc: dict[str, Any]) -> tuple[str, str | None]:
    """``("finished", None)`` when at least one mechanism measured the jobs together, else
    ``("failed", why)``: a job that failed alone, or what stopped every mechanism."""
    if any(r.get("status") == "ok" for r in doc["results"]):
        return "finished", None
    for job in doc["jobs"]:
        if job.get("error"):
            return "failed", f"nothing could be measured: job {job['name']} failed alone: " + str(
                job["error"]
            )
    reasons = [f"{r['mechanism']}: {r.get('error') or r.get('status')}" for r in doc["results"]]
    return "failed", "nothing could be measured: " + ("; ".join(reasons) or "no mechanism ran")


def result_label(result: dict[str, Any]) -> str:
    mech = {"mps": "MPS", "mig": "MIG", "streams": "streams", "time-slice": "time-slicing"}
    setting = result.get("setting")
    name = mech.get(result["mechanism"], result["mechanism"])
    return f"{name} ({setting})" if setting and setting != "default" else name
