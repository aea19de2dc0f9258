"""The highest rate a tenant sustains within its SLO (``--find-max``), and rate sweeps.

``find_max`` grows the rate exponentially (×2) from the tenant's given rate until a trial
fails, or halves it until one passes, then bisects between the highest pass and the lowest
fail until they are within ``tolerance`` of each other, the trials run out or the time budget
is spent. A trial passes when the tenant's SLO attainment is at least ``min_attainment``
(0.99: p99 latency within the SLO, errors counting as misses); the other tenants keep their
rates and their attainment is reported beside it. Each trial is a caller's function of the
rate returning the load document, so the search itself does no I/O.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from gpulens.errors import UsageError

log = logging.getLogger(__name__)

TrialFn = Callable[[float], dict]
MIN_RATE_RPS = 0.1


@dataclass(frozen=True)
class Trial:
    rate_rps: float
    slo_attainment: float | None
    p99_ms: float | None
    achieved_rate_rps: float
    passed: bool
    others_slo_attainment: dict


def _tenant(doc: dict, model: str) -> dict:
    return next(t for t in doc["tenants"] if t["model"] == model)


def judge(doc: dict, model: str, rate: float, min_attainment: float) -> Trial:
    t = _tenant(doc, model)
    att = t["slo_attainment"]
    others = {o["model"]: o["slo_attainment"] for o in doc["tenants"] if o["model"] != model}
    return Trial(
        rate_rps=round(rate, 4),
        slo_attainment=att,
        p99_ms=t["latency_ms"]["p99"],
        achieved_rate_rps=t["achieved_rate_rps"],
        passed=att is not None and att >= min_attainment,
        others_slo_attainment=others,
    )


def require_slo(model: str, slo_ms: float | None) -> None:
    """``--find-max`` searches for the highest rate within the tenant's SLO: it needs one."""
    if slo_ms is None:
        raise UsageError(
            f"--find-max {model}: the tenant needs an SLO, e.g. {model}:rate=R:slo_ms=50"
        )


def find_max(
    trial: TrialFn,
    model: str,
    start_rate_rps: float,
    slo_ms: float | None,
    *,
    max_trials: int = 12,
    tolerance: float = 0.05,
    min_attainment: float = 0.99,
    budget_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[dict, dict | None]:
    """(the search's result, the document of the best passing trial or None)."""
    require_slo(model, slo_ms)
    t_start = clock()
    trials: list[Trial] = []
    lo: float | None = None  # highest passing rate
    hi: float | None = None  # lowest failing rate
    best_doc = None
    rate = start_rate_rps
    converged = False
    while len(trials) < max_trials:
        if budget_s is not None and trials and clock() - t_start >= budget_s:
            break
        doc = trial(rate)
        result = judge(doc, model, rate, min_attainment)
        trials.append(result)
        log.info("find-max %s: %.2f req/s -> attainment %s", model, rate, result.slo_attainment)
        if result.passed:
            if lo is None or rate > lo:
                lo, best_doc = rate, doc
        elif hi is None or rate < hi:
            hi = rate
        if hi is None:
            rate = rate * 2.0
        elif lo is None:
            rate = rate / 2.0
            if rate < MIN_RATE_RPS:
                break
        else:
            if (hi - lo) <= tolerance * lo:
                converged = True
                break
            rate = (lo + hi) / 2.0
    result = {
        "tenant": model,
        "slo_ms": slo_ms,
        "criterion": f"slo_attainment >= {min_attainment} (p99 latency <= slo_ms, errors miss)",
        "max_rate_rps": round(lo, 4) if lo is not None else None,
        "lowest_failing_rate_rps": round(hi, 4) if hi is not None else None,
        "converged": converged,
        "tolerance": tolerance,
        "trials": [asdict(t) for t in trials],
        "search_s": round(clock() - t_start, 3),
    }
    return result, best_doc


def sweep(trial: TrialFn, model: str, rates: tuple[float, ...], min_attainment: float = 0.99):
    """One trial per rate: ([per-rate summary], the last trial's document)."""
    rows, doc = [], None
    for rate in rates:
        doc = trial(rate)
        t = _tenant(doc, model)
        row = asdict(judge(doc, model, rate, min_attainment))
        row.update(latency_ms=t["latency_ms"], goodput_rps=t["goodput_rps"],
                   errors=t["errors"]["count"])  # fmt: skip
        rows.append(row)
    return rows, doc


def sweep_concurrency(trial: Callable[[int], dict], model: str, levels: tuple[int, ...]):
    """One closed-loop trial per concurrency level: ([per-level summary of ``model``], the
    last trial's document). Throughput rises with concurrency until the server saturates;
    past that only latency grows (Little's law: concurrency = rate x latency)."""
    rows, doc = [], None
    for level in levels:
        doc = trial(level)
        t = _tenant(doc, model)
        rows.append({
            "concurrency": level, "achieved_rate_rps": t["achieved_rate_rps"],
            "latency_ms": t["latency_ms"], "slo_attainment": t["slo_attainment"],
            "goodput_rps": t["goodput_rps"], "errors": t["errors"]["count"],
        })  # fmt: skip
    return rows, doc
