"""Does pinning loader workers to physical cores make a loader-bound run repeatable?

Alternates short training runs over cached JPEGs with the workers left to the scheduler ("os")
and pinned one per core ("cores"), ABBA order so slow drift of the machine hits both alike, and
reports for each: mean throughput, the spread between runs (CV) and the runs' own 95% CIs. If
the runs' CIs are much narrower than the spread between runs, a single run's CI understates how
far a re-run lands.

    PYTHONPATH=src python benchmarks/worker_affinity.py --data /tmp/img20k --repeats 6
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

from gpulens.data.affinity import physical_cores, worker_cpus
from gpulens.workloads.config import TrainConfig
from gpulens.workloads.train import run_training


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--workload", default="resnet50")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--duration", type=float, default=12.0, help="measured seconds per run")
    ap.add_argument("--repeats", type=int, default=6, help="runs of each affinity")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    allowed = set(os.sched_getaffinity(0))
    cores = physical_cores(allowed)
    print(f"{len(allowed)} CPUs on {len(cores)} cores; pinned workers on CPUs "
          f"{worker_cpus(args.workers, allowed)}", flush=True)  # fmt: skip
    pairs = [("os", "cores") if i % 2 else ("cores", "os") for i in range(args.repeats)]
    order = [affinity for pair in pairs for affinity in pair]
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, affinity in enumerate(order):
            cfg = TrainConfig(
                workload=args.workload, data=args.data, workers=args.workers,
                batch_size=args.batch_size, precision=args.precision, duration_s=args.duration,
                worker_affinity=affinity, sample_hz=2.0,
            )  # fmt: skip
            r = run_training(cfg, Path(tmp))
            s = r.summary
            rate, ci = s["throughput_samples_per_s"], s["throughput_ci95_pct"]
            rows.append({"i": i, "affinity": affinity, "samples_per_s": rate, "ci95_pct": ci,
                         "measured_wall_s": s["measured_wall_s"]})  # fmt: skip
            print(f"[{time.perf_counter() - t0:6.1f} s] {affinity:5s} {rate:7.1f} samples/s "
                  f"± {ci:.1f}%", flush=True)  # fmt: skip
    summary = {}
    for affinity in ("os", "cores"):
        x = np.array([r["samples_per_s"] for r in rows if r["affinity"] == affinity])
        ci = np.array([r["ci95_pct"] for r in rows if r["affinity"] == affinity])
        summary[affinity] = {
            "runs": int(x.size),
            "mean_samples_per_s": float(x.mean()),
            "between_run_cv_pct": float(100 * x.std(ddof=1) / x.mean()),
            "range_pct": float(100 * (x.max() - x.min()) / x.mean()),
            "mean_within_run_ci95_pct": float(ci.mean()),
        }
    doc = {
        "benchmark": "worker_affinity",
        "date": date.today().isoformat(),
        "command": " ".join(["python", *sys.argv]),
        "cpus": len(allowed),
        "cores": len(cores),
        "lscpu": subprocess.run(["lscpu"], capture_output=True, text=True).stdout,
        "summary": summary,
        "rows": rows,
    }
    out = args.out or Path(os.environ.get("OUT", "benchmarks/results"), "worker_affinity.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"{'affinity':8s} {'runs':>4s} {'samples/s':>10s} {'CV between':>11s} "
          f"{'range':>7s} {'mean CI':>8s}")  # fmt: skip
    for affinity, s in summary.items():
        print(f"{affinity:8s} {s['runs']:4d} {s['mean_samples_per_s']:10.1f} "
              f"{s['between_run_cv_pct']:10.2f}% {s['range_pct']:6.1f}% "
              f"{s['mean_within_run_ci95_pct']:7.2f}%")  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
