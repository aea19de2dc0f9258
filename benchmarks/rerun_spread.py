"""How far a rerun of one configuration lands: on the same machine, and on another machine with
the same GPU (issue 17; what `advise` spreads the run's own configuration by).

    python benchmarks/rerun_spread.py RUNS.tar.xz [...] [--out FILE.json]

RUNS are the committed ladders and records (`predict-ladder-*.tar.xz`, `predict-records-*`), each
file one machine (one device call). Every pair of runs of one configuration (GPU model, workload,
precision, data, batch, GPU count, workers) takes one run's throughput as the other's prediction:
``same machine`` where both came from one file, ``another machine`` where they did not. A pair is
GPU-paced where both runs' kernels and queued gaps filled at least GPU_BOUND_FILL of their step
(a profiler window), host-paced where either filled less, unknown without a window; and by the
rule `advise` applies (``batch.gpu_set_the_pace``: the window, else NVML's utilization). Each
configuration's pairs are averaged first, then the configurations, so that a configuration run on
many machines does not outweigh the others; the mean over all pairs is given too.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from predict_same_gpu import _config, _gpu_fill, _point
from predict_validation import load_records

from gpulens.predict.advise import Z_P90, error_sigma
from gpulens.predict.batch import GPU_BOUND_FILL, gpu_set_the_pace
from gpulens.predict.validation import ape_pct


def pace(a: dict, b: dict) -> str:
    """By the profiler window alone: unknown where either run has none."""
    fills = [_gpu_fill(p) for p in (a, b)]
    if None in fills:
        return "unknown"
    return "gpu_paced" if min(fills) >= GPU_BOUND_FILL else "host_paced"


def pace_by_rule(a: dict, b: dict) -> str:
    """By the rule `advise` applies to a run (``batch.gpu_set_the_pace``): the window where
    there is one, else NVML's utilization."""
    both = all(gpu_set_the_pace(_gpu_fill(p), p["gpu_util_pct"]) for p in (a, b))
    return "gpu_paced" if both else "host_paced"


def pair_rows(points: list[dict]) -> list[dict]:
    """Every ordered pair of runs of one configuration, one taking the other as its prediction."""
    groups = defaultdict(list)
    for p in points:
        groups[_config(p)].append(p)
    rows = []
    for config, runs in groups.items():
        for a in runs:
            for b in runs:
                if a is b:
                    continue
                rows.append({
                    "config": "/".join(map(str, config)),
                    "from": a["run_id"], "to": b["run_id"],
                    "where": "same_machine" if a["origin"] == b["origin"] else "another_machine",
                    "pace": pace(a, b), "pace_by_rule": pace_by_rule(a, b),
                    "ape_pct": ape_pct(a["tput"], b["tput"]),
                    "time_ratio": a["tput"] / b["tput"],  # measured time over predicted
                })  # fmt: skip
    return rows


def figure(rows: list[dict]) -> dict | None:
    if not rows:
        return None
    by_config = defaultdict(list)
    for r in rows:
        by_config[r["config"]].append(r["ape_pct"])
    mape = statistics.fmean(statistics.fmean(v) for v in by_config.values())
    p90 = math.exp(Z_P90 * error_sigma(mape))  # advise's p90 of a time with this error
    return {
        "configs": len(by_config),
        "pairs": len(rows) // 2,  # each unordered pair is scored both ways
        "mape_pct_by_config": mape,
        "mape_pct_all_pairs": statistics.fmean(r["ape_pct"] for r in rows),
        "p90_factor": p90,
        "held_within_p90": statistics.fmean(r["time_ratio"] <= p90 for r in rows),
    }


def by_config(rows: list[dict]) -> list[dict]:
    """Each configuration's pairs, by where the two runs were and by advise's rule."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["config"], r["where"], r["pace_by_rule"])].append(r["ape_pct"])
    return [
        {"config": c, "where": w, "pace_by_rule": p, "pairs": len(v) // 2,
         "mape_pct": round(statistics.fmean(v), 3)}
        for (c, w, p), v in sorted(groups.items())
    ]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        points = []
        for i, path in enumerate(args.runs):  # one at a time: each file is one origin
            for p in map(_point, load_records([path], Path(tmp) / str(i))):
                if p:
                    p["origin"] = path.name
                    p["gpu_util_pct"] = (p["record"].meta["summary"].get("gpu") or {}).get(
                        "gpu_util_pct"
                    )
                    p.pop("record")
                    points.append(p)
    rows = pair_rows(points)
    summary = {}
    print(f"{'where':<16} {'pace':<11} {'configs':>7} {'pairs':>6} {'by config':>10} {'all':>7} "
          f"{'<= p90':>7}")  # fmt: skip
    for field, kinds, suffix in (
        ("pace", ("gpu_paced", "host_paced", "unknown"), ""),
        ("pace_by_rule", ("gpu_paced", "host_paced"), "_by_rule"),
    ):
        if suffix:
            print("by advise's rule (the window, else NVML utilization):")
        for where in ("same_machine", "another_machine"):
            for kind in kinds:
                f = figure([r for r in rows if r["where"] == where and r[field] == kind])
                if f:
                    summary[f"{where}_{kind}{suffix}"] = f
                    by_config_pct, all_pct = f["mape_pct_by_config"], f["mape_pct_all_pairs"]
                    print(f"{where:<16} {kind:<11} {f['configs']:>7} {f['pairs']:>6} "
                          f"{by_config_pct:>9.1f}% {all_pct:>6.1f}% "
                          f"{f['held_within_p90']:>6.1%}")  # fmt: skip
    if args.out:
        command = "python benchmarks/rerun_spread.py " + " ".join(p.as_posix() for p in args.runs)
        args.out.write_text(
            json.dumps(
                {"command": command, "summary": summary, "configs": by_config(rows)}, indent=1
            )
            + "\n"  # fmt: skip
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
