"""Collocation figures, pure: slowdown (alone / together), normalized aggregate throughput,
Jain's fairness index, energy (per unit of what each job counts, and against running the jobs
alone), and whether the jobs fit in GPU memory together."""

from __future__ import annotations

import logging
import math
from typing import Any

from gpulens.workloads.jobspec import throughput_unit

log = logging.getLogger(__name__)


# A CUDA context (and the libraries torch loads into it) costs memory beyond what the caching
# allocator reserves; about 0.5 GiB on an H100 with torch 2.x. Counted once per process.
CONTEXT_BYTES = 600 * 2**20


MEM_USABLE_FRACTION = 0.97


# ------------------------------------------------------------------------------ arithmetic
def slowdown(alone: float | None, together: float | None) -> float | None:
    """alone / together: 1.0 unaffected, 2.0 half speed; None when either is missing."""
    if not alone or together is None:
        return None
    if together <= 0:
        return float("inf")
    return alone / together


def normalized_throughputs(pairs: list[tuple[float | None, float | None]]) -> list[float] | None:
    """together/alone per job; None if any is missing."""
    out = []
    for alone, together in pairs:
        if not alone or together is None:
            return None
        out.append(together / alone)
    return out


def jain_index(xs: list[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1.0 all equal, 1/n one job gets all."""
    if not xs:
        return None
    sq = sum(x * x for x in xs)
    if sq == 0:
        return None
    return sum(xs) ** 2 / (len(xs) * sq)


def energy_per_sample(energy_j: float | None, samples: float | None) -> float | None:
    if energy_j is None or not samples:
        return None
    return energy_j / samples


# What a joule is spent on, from what a job's throughput counts.
ENERGY_UNITS = {"samples/s": "J/sample", "requests/s": "J/request", "runs/s": "J/run"}
# units a sample is one of: a training sample, an inference request of one sample
SAMPLE_UNITS = ("samples/s", "requests/s")


def energy_unit(throughput_unit: str | None) -> str | None:
    """``J/sample``, ``J/request`` or ``J/run`` for a throughput in samples/s, requests/s or
    runs/s."""
    return ENERGY_UNITS.get(throughput_unit or "")


def job_energy(per_unit: float | None, unit: str) -> dict[str, Any]:
    """A job's energy per unit alone in its own unit (``energy_per_unit_alone_j`` with
    ``energy_unit``); ``energy_per_sample_alone_j`` only where its unit is a sample (never a
    ``cmd:`` job's whole runs)."""
    return {"energy_per_unit_alone_j": per_unit, "energy_unit": energy_unit(unit),
            "energy_per_sample_alone_j": per_unit if unit in SAMPLE_UNITS else None}  # fmt: skip


def mechanism_energy(
    energy_j: float | None, jobs: list[dict[str, Any]], why_unmeasured: str | None = None
) -> dict[str, Any]:
    """A mechanism's energy figures from the GPU energy of its window and, per job, ``unit``
    (what its throughput counts), ``count`` (samples, requests or runs done together) and
    ``alone_j`` (its energy per unit alone).

    - ``energy_vs_alone_ratio``: the window's energy over what the same work took with each
      job alone (sum of count x alone_j): 0.8 = the work took 20% less energy together. It
      compares mechanisms whatever the jobs count, and the recommendation uses only it.
    - ``energy_per_unit_j`` (in ``energy_unit``): energy / all units done, only when every job
      counts the same thing; ``energy_per_sample_j`` the same only when that thing is a sample
      (or a one-sample request). Jobs that count different things get null and
      ``energy_note`` says why."""
    units = {j["unit"] for j in jobs}
    shared = units.pop() if len(units) == 1 else None
    per_unit = energy_per_sample(energy_j, sum(j["count"] or 0 for j in jobs)) if shared else None
    alone = [(j["count"] or 0) * j["alone_j"] for j in jobs if j["alone_j"] is not None]
    ratio = energy_j / sum(alone) if energy_j is not None and len(alone) == len(jobs) and \
        sum(alone) > 0 else None  # fmt: skip
    note = None
    if energy_j is None:
        note = "energy not measured" + (f": {why_unmeasured}" if why_unmeasured else "")
    elif shared is None and jobs:
        note = ("no energy per unit: the jobs count different things ("
                + ", ".join(sorted({energy_unit(j["unit"]) or "?" for j in jobs}))
                + "); energy_vs_alone_ratio compares the mechanisms")  # fmt: skip
    elif ratio is None:
        note = "no energy_vs_alone_ratio: a job's energy alone was not measured"
    return {"energy_unit": energy_unit(shared), "energy_per_unit_j": per_unit,
            "energy_per_sample_j": per_unit if shared in SAMPLE_UNITS else None,
            "energy_vs_alone_ratio": ratio, "energy_note": note}  # fmt: skip


def memory_fit(
    peaks_bytes: list[int | None],
    total_bytes: int | None,
    processes: int,
    context_bytes: int = CONTEXT_BYTES,
) -> tuple[bool | None, int | None, str | None]:
    """(fits, bytes needed, why not) from alone-run peaks. ``None`` fits = cannot tell."""
    if total_bytes is None or any(p is None for p in peaks_bytes):
        return None, None, None
    needed = int(sum(p for p in peaks_bytes if p is not None) + processes * context_bytes)
    usable = int(total_bytes * MEM_USABLE_FRACTION)
    if needed > usable:
        return (
            False,
            needed,
            (
                f"does not fit: needs about {needed / 2**30:.1f} GiB (alone-run peaks plus "
                f"{processes} CUDA context(s)) of {total_bytes / 2**30:.1f} GiB"
            ),
        )
    return True, needed, None


def summarize_result(result: dict[str, Any]) -> dict[str, Any]:
    """Fill a result's overall numbers from its jobs (used for measured and loaded results)."""
    jobs = result["jobs"]
    ratios = normalized_throughputs([(j["throughput_alone"], j["throughput_together"])
                                     for j in jobs])  # fmt: skip
    result["normalized_aggregate_throughput"] = sum(ratios) if ratios is not None else None
    result["jain_fairness"] = jain_index(ratios) if ratios is not None else None
    return result


def quadrature(*pcts: float | None) -> float | None:
    if any(p is None for p in pcts):
        return None
    return math.sqrt(sum(p * p for p in pcts))


def slo_attainment(latencies_s: list[float] | None, slo_ms: float | None) -> float | None:
    """The share of requests answered within ``slo_ms`` (latency from the scheduled arrival);
    None without an SLO or without requests."""
    if slo_ms is None or not latencies_s:
        return None
    return sum(1 for t in latencies_s if 1000.0 * t <= slo_ms) / len(latencies_s)


def slo_fields(slo_ms: float | None, alone: float | None, together: float | None) -> dict:
    """A job's SLO columns: attainment alone and together, and the points lost together."""
    if slo_ms is None:
        return {}
    lost = 100.0 * (alone - together) if alone is not None and together is not None else None
    return {"slo_ms": slo_ms, "slo_attainment_alone": alone, "slo_attainment": together,
            "slo_attainment_lost_pp": lost}  # fmt: skip


def throughput_units(doc: dict[str, Any]) -> dict[str, str]:
    """Each job's throughput unit by name (samples/s, requests/s, runs/s) from a colocate
    document; a document written before jobs carried ``throughput_unit`` gets it from the
    job's kind and batch."""
    return {
        str(j.get("name")): j.get("throughput_unit")
        or throughput_unit(j.get("kind") or "train", j.get("batch_size"))
        for j in doc.get("jobs") or []
    }
