"""Recompute a stall breakdown from the run records `gpulens stalls` left behind.

Reads every `stalls-<workload>-<kind>` record under RUNS (a runs folder, or a .tgz of one such
as benchmarks/results/stalls-resnet50-records-*.tgz), recomputes each run's throughput CI with
the current method (the GPU's step times where known), pools repeated runs of a kind, and prints
the breakdown with its 95% intervals as JSON.

    python benchmarks/stalls_from_records.py RUNS
"""

from __future__ import annotations

import json
import sys
import tarfile
import tempfile
from pathlib import Path

from gpulens.experiments.stalls import _breakdown_of, pooled
from gpulens.record.reader import read_record
from gpulens.stats import throughput_ci
from gpulens.workloads.train import TrainResult, ci_step_times


def _clean(value):
    return None if isinstance(value, float) and value != value else value


def load_runs(runs_dir: Path) -> dict[str, list[TrainResult]]:
    by_kind: dict[str, list[TrainResult]] = {}
    for run_dir in sorted(p for p in runs_dir.iterdir() if (p / "run.json").exists()):
        rec = read_record(run_dir)
        name, summary = rec.meta.get("name") or "", dict(rec.meta["summary"])
        if not name.startswith("stalls-"):
            continue
        kind = next(k for k in ("ingestion_free", "cached", "cold", "multi_gpu_socket",
                                "multi_gpu") if name.endswith(k))  # fmt: skip
        steps = rec.series("steps")
        rows = [{k: _clean(v) for k, v in r.items()}
                for r in steps[~steps["warmup"]].to_dict("records")]  # fmt: skip
        ci = throughput_ci(ci_step_times(rows), summary["global_batch_size"])
        summary["throughput_ci95_pct"] = ci.ci95_pct if ci else None
        by_kind.setdefault(kind, []).append(TrainResult(rec.meta["run_id"], run_dir, summary))
    return by_kind


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    source = Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        if source.suffix in (".tgz", ".gz"):
            with tarfile.open(source) as tar:
                tar.extractall(tmp, filter="data")
            source = Path(tmp) / "runs"
        runs = load_runs(source)
        measured = {kind: pooled(results) for kind, results in runs.items()}
        shares, cis = _breakdown_of(measured)
        doc = {
            "runs": {
                k: [
                    (
                        r.run_id,
                        round(r.summary["throughput_samples_per_s"], 1),
                        r.summary["throughput_ci95_pct"],
                    )
                    for r in v
                ]
                for k, v in runs.items()
            },  # fmt: skip
            "throughput_ci95_pct": {
                k: 100 * m.half_width_s / m.per_sample_s for k, m in measured.items() if m
            },
            "breakdown_pct": shares,
            "breakdown_ci95_pp": cis,
        }
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
