"""Leave-one-ladder-out check of the per-worker decline in `predict --workers` (issue 17).

    python benchmarks/workers_decline_cv.py results/predict_same_gpu-workers-eleven_ladders-*.json
        [--out FILE.json]

The scored JSON (predict_same_gpu.py on the workers ladders, by the predictor of this
checkout) holds every run-to-run case with its prediction. A loader-bound prediction is the
source loader's pace x the workers' ratio x one worker's pace ratio, so each case's prediction
without a pace ratio is its prediction over the ratio it was made with (predict's own
worker_decline_ratio, so score the JSON with this checkout). For each ladder the decline
constant and the CPUs the training process takes (where the workers need more than the run
has) are fitted on the other ladders (least mean absolute percentage error, run by run) and
scored on it: run by run, and as the median prediction of 3+ source runs against the median of
3+ target runs. Beside it: the bound used before (each worker held to CPUs / (W + 1), its own
decline constant fitted the same way), the decline per share of the CPUs (the rule until
2026-11-27, whose CPU scaling the 8- and 32-CPU ladders tested), the run's loader probe's ratio
(from the source's run.json in the bundles the JSON names; what `predict` used until
2026-11-27) and no ratio at all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tarfile
from collections import defaultdict
from pathlib import Path

import numpy as np

from gpulens.predict.workers import (
    host_cpus,
    probe_pace_ratio,
    worker_decline_ratio,
)

# "decline": predict's own rule (workers.worker_pace: a decline per extra worker, and the
# workers sharing what the training process leaves of the CPUs), fitted as (decline, training
# process CPUs); "bound": the same decline with each worker held to CPUs / (W + 1), the rule of
# 2026-11-27 before the 4- and 2-CPU ladders; "per_cpu": the rule before that, a decline per
# share of the host's CPUs, 1 / (1 + c (W - 1) / CPUs), fitted then on 16-vCPU hosts only;
# "probe": the run's loader probe; "none": no ratio
_DECLINES = [i / 1000 for i in range(0, 81)]  # per extra worker
GRIDS = {
    "decline": [(d, f / 10) for d in _DECLINES for f in range(0, 10)],
    "bound": _DECLINES,
    "per_cpu": [i / 100 for i in range(0, 101)],  # per extra worker's share of the CPUs
}
HOWS = ("decline", "bound", "per_cpu", "probe", "none")


def _bound_pace(workers: int, cpus: int | None, decline: float) -> float:
    pace = 1.0 / (1.0 + decline * (workers - 1))
    return min(pace, cpus / (workers + 1)) if cpus and workers + 1 > cpus else pace


def _per_cpu_ratio(cpus: int, from_workers: int, to_workers: int, decline: float) -> float:
    share = decline / max(cpus, 1)
    return (1.0 + share * (from_workers - 1)) / (1.0 + share * (to_workers - 1))


def _run_metas(bundles: list[Path]) -> dict[str, dict]:
    metas = {}
    for bundle in bundles:
        with tarfile.open(bundle) as tar:
            for member in tar.getmembers():
                if member.name.endswith("/run.json"):
                    meta = json.load(tar.extractfile(member))
                    metas[meta["run_id"]] = meta
    return metas


def _ape(predicted: float, measured: float) -> float:
    return abs(predicted / measured - 1.0) * 100.0


def _predict(case: dict, how: str, decline) -> float:
    """The case's prediction by ``how``, with its fitted constant(s) ``decline``."""
    return case["unscaled"] * _ratio(
        how, case["from_workers"], case["to_workers"], case["recorded_cpus"], case["cpus"],
        case["probe"], decline,
    )  # fmt: skip


def _ratio(how, from_workers, to_workers, recorded_cpus, cpus, probe, decline) -> float:
    if how == "probe":
        return probe
    if how == "none":
        return 1.0
    if how == "per_cpu":
        return _per_cpu_ratio(cpus, from_workers, to_workers, decline)
    if how == "bound":
        return _bound_pace(to_workers, recorded_cpus, decline) / _bound_pace(
            from_workers, recorded_cpus, decline
        )
    return worker_decline_ratio(from_workers, to_workers, recorded_cpus, *decline)


def _ape_table(cases: list[dict], how: str) -> np.ndarray:
    """Each case's absolute percentage error (columns) under each constant of ``how``'s grid
    (rows), computed once per distinct (from, to, CPUs) so the folds' fits are a lookup."""
    keys = [(c["from_workers"], c["to_workers"], c["recorded_cpus"], c["cpus"]) for c in cases]
    distinct = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    index = np.array([distinct[key] for key in keys])
    unscaled = np.array([c["unscaled"] for c in cases])
    measured = np.array([c["measured_samples_per_s"] for c in cases])
    rows = []
    for constant in GRIDS[how]:
        ratios = np.array([_ratio(how, *key, 1.0, constant) for key in distinct])
        rows.append(np.abs(unscaled * ratios[index] / measured - 1.0) * 100.0)
    return np.vstack(rows)


def _fit(table: np.ndarray, how: str, mask: np.ndarray):
    """The grid's constant of least mean error over the cases in ``mask``."""
    return GRIDS[how][int(np.argmin(table[:, mask].mean(axis=1)))]


def _medians(cases: list[dict], how: str, decline) -> list[float]:
    groups = defaultdict(list)
    for c in cases:
        groups[(c["from_workers"], c["to_workers"], c["workload"])].append(c)
    out = []
    for cs in groups.values():
        sources = {c["from"]: _predict(c, how, decline) for c in cs}
        targets = {c["to"]: c["measured_samples_per_s"] for c in cs}
        if len(sources) >= 3 and len(targets) >= 3:
            out.append(
                _ape(statistics.median(sources.values()), statistics.median(targets.values()))
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scored", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    doc = json.loads(args.scored.read_text())
    bundles = [Path(a) for a in doc["command"].split() if a.endswith(".tar.xz")]
    base = args.scored.parent.parent  # the command names results/... from benchmarks/
    metas = _run_metas([b if b.is_file() else base / b for b in bundles])
    cases = []
    for c in doc["worker_run_cases"]:
        meta = metas[c["from"]]
        recorded = host_cpus(meta)
        made_with = worker_decline_ratio(c["from_workers"], c["to_workers"], recorded)
        probe, _ = probe_pace_ratio(meta, c["from_workers"], c["to_workers"])
        unscaled = c["predicted_samples_per_s"] / made_with
        cases.append(
            {**c, "unscaled": unscaled, "probe": probe, "recorded_cpus": recorded,
             "cpus": recorded or 16}
        )  # fmt: skip
    ladders = sorted({c["origin"] for c in cases}, key=int)
    tables = {how: _ape_table(cases, how) for how in GRIDS}
    origins = np.array([c["origin"] for c in cases])
    rows, pooled = [], defaultdict(list)
    for held in ladders:
        test = [c for c in cases if c["origin"] == held]
        fitted = {how: _fit(tables[how], how, origins != held) for how in GRIDS}
        row = {
            "ladder": bundles[int(held)].name,
            "cpus": sorted({c["cpus"] for c in test}),
            "cases": len(test),
            "decline_fitted_on_the_others": fitted["decline"][0],
            "training_cpus_fitted_on_the_others": fitted["decline"][1],
            "bound_fitted_on_the_others": fitted["bound"],
            "per_cpu_fitted_on_the_others": fitted["per_cpu"],
        }
        for how in HOWS:
            decline = fitted.get(how, 0.0)
            singles = [_ape(_predict(c, how, decline), c["measured_samples_per_s"]) for c in test]
            medians = _medians(test, how, decline)
            pooled[how] += singles
            pooled[how + "_medians"] += medians
            row[f"{how}_mape_pct"] = statistics.mean(singles)
            row[f"{how}_median_cases"] = len(medians)
            row[f"{how}_medians_mape_pct"] = statistics.mean(medians) if medians else None
        rows.append(row)
    everything = np.ones(len(cases), dtype=bool)
    fitted_all = {how: _fit(tables[how], how, everything) for how in GRIDS}
    summary = {
        how: {
            "cases": len(pooled[how]),
            "mape_pct": statistics.mean(pooled[how]),
            "median_cases": len(pooled[how + "_medians"]),
            "medians_mape_pct": statistics.mean(pooled[how + "_medians"]),
        }
        for how in HOWS
    }
    for how in GRIDS:
        summary[f"{how}_fitted_on_all"] = fitted_all[how]
        summary[f"{how}_in_sample_mape_pct"] = float(
            tables[how][GRIDS[how].index(fitted_all[how])].mean()
        )
    print(
        f"{'held-out ladder':<52} {'cpus':>4} {'fit':>9} {'decline':>7} {'bound':>6} "
        f"{'per_cpu':>7} {'probe':>6} {'none':>6}  (medians)"
    )
    for r in rows:
        print(
            f"{r['ladder'][:52]:<52} {','.join(map(str, r['cpus'])):>4} "
            f"{r['decline_fitted_on_the_others']:5.3f},"
            f"{r['training_cpus_fitted_on_the_others']:.1f} "
            f"{r['decline_mape_pct']:6.1f}% {r['bound_mape_pct']:5.1f}% "
            f"{r['per_cpu_mape_pct']:6.1f}% {r['probe_mape_pct']:5.1f}% {r['none_mape_pct']:5.1f}%"
            + (
                "  (" + " / ".join(f"{r[how + '_medians_mape_pct']:.1f}" for how in HOWS) + "%)"
                if r["decline_median_cases"]
                else "  (no configuration run 3 times)"
            )
        )
    for how in HOWS:
        s = summary[how]
        print(
            f"{how:<8} run by run {s['mape_pct']:5.2f}% over {s['cases']}, medians "
            f"{s['medians_mape_pct']:5.2f}% over {s['median_cases']}"
        )
    for how in GRIDS:
        print(
            f"{how} fitted on all {len(ladders)} ladders: {fitted_all[how]} "
            f"({summary[how + '_in_sample_mape_pct']:.2f}% in sample)"
        )
    if args.out:
        command = "python workers_decline_cv.py " + " ".join(sys.argv[1:])
        out = {"command": command, "summary": summary, "ladders": rows}
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
