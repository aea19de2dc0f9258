"""The analysis outputs the run-contract refactor (issue 13) must leave unchanged, computed from
records made on a real H100. ``compute_all()`` is the only place that knows where the analysis
functions live: when a function moves, its import here changes; the expected JSON never does.

    python -m tests.golden.outputs --write     # only when a change of numbers is intended
"""

from __future__ import annotations

import json
import math
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
FIXTURES = HERE.parent / "fixtures"
RESULTS = HERE.parents[1] / "benchmarks" / "results"
EXPECTED = HERE / "expected_outputs.json"
POOLED_RECORDS = RESULTS / "stalls-resnet50-pooled-records-NVIDIA_H100_80GB_HBM3-2026-11-23.tgz"
ROLES = ("ingestion_free", "cached", "cold", "multi_gpu_socket", "multi_gpu")


def _round(value: Any) -> Any:
    """Floats to 9 significant digits, so the comparison ignores only float noise."""
    if isinstance(value, float):
        return None if math.isnan(value) else float(f"{value:.9g}")
    if isinstance(value, dict):
        return {str(k): _round(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_round(v) for v in value]
    return value


def _stall_breakdown(runs_dir: Path) -> dict[str, Any]:
    from gpulens.record.reader import read_record
    from gpulens.stalls import breakdown_of, pooled, recommend, what_if

    by_role: dict[str, list] = {}
    for run_dir in sorted(p for p in runs_dir.iterdir() if (p / "run.json").exists()):
        rec = read_record(run_dir)
        name = rec.meta.get("name") or ""
        role = next(r for r in ROLES if name.endswith(r))
        result = rec.result()
        by_role.setdefault(role, []).append(result)
    measured = {role: pooled(results) for role, results in by_role.items()}
    shares, cis = breakdown_of(measured)
    cached = by_role["cached"][0].summary
    predictions = what_if(
        measured["ingestion_free"], measured["cached"], measured.get("cold"),
        workers=cached["workers"], cpu_count=16, mean_file_bytes=103_000.0,
        prep_cpu_s_per_sample=0.004,
    )  # fmt: skip
    current = 1.0 / measured["cold"].per_sample_s
    return {
        "runs": {role: [r.run_id for r in rs] for role, rs in sorted(by_role.items())},
        "per_sample_s": {r: m.per_sample_s for r, m in measured.items() if m},
        "half_width_s": {r: m.half_width_s for r, m in measured.items() if m},
        "breakdown_pct": shares,
        "breakdown_ci95_pp": cis,
        "what_if": predictions,
        "recommendations": recommend(shares, predictions, current, cached["workers"]),
    }


def _run_summary(record_dir: Path) -> dict[str, Any]:
    from gpulens.probes.summary import summarize_gpu, summarize_host
    from gpulens.record.reader import read_record
    from gpulens.stats import throughput_ci
    from gpulens.workloads.loop import ci_step_times

    rec = read_record(record_dir)
    s = rec.meta["summary"]
    steps = rec.series("steps")
    measured = steps[~steps["warmup"]]
    rows = measured.to_dict("records")
    t0 = measured["time_unix_s"].iloc[0] - measured["step_time_s"].iloc[0]
    t1 = measured["time_unix_s"].iloc[-1] + 0.05
    samples = s["batch_size"] * s["measured_steps"]
    ci = throughput_ci(ci_step_times(rows), s["batch_size"])
    return {
        "gpu": summarize_gpu(rec.series("gpu"), t0, t1, 0, samples),
        "host": summarize_host(rec.series("host"), t0, t1),
        "throughput_ci95_pct": ci.ci95_pct if ci else None,
    }


def _prep_and_paired(record_dir: Path) -> dict[str, Any]:
    from gpulens.record.reader import read_prep
    from gpulens.stalls.paired_fetch import paired_fetch
    from gpulens.stalls.prep_summary import summarize_prep

    meta = json.loads((record_dir / "run.json").read_text())
    s, eff = meta["summary"], meta["effective_config"]
    window = (s["measured_start_unix_s"], s["measured_end_unix_s"])
    return {
        "paired_fetch": paired_fetch(record_dir, eff["paired_cold_samples"], eff["seed"], *window),
        "prep_rows": len(read_prep(record_dir, *window)),
        "prep_summary": summarize_prep(
            record_dir,
            s["throughput_samples_per_s"],
            workers=eff["workers"],
            start_unix_s=window[0],
            end_unix_s=window[1],
            data_wait_fraction=0.3,
        ),
    }


def compute_all() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(POOLED_RECORDS) as tar:
            tar.extractall(tmp, filter="data")
        stalls = _stall_breakdown(Path(tmp) / "runs")
    return _round(
        {
            "stalls_pooled_h100": stalls,
            "run_summary_h100_jpeg": _run_summary(FIXTURES / "record_h100_resnet50_jpeg"),
            "prep_paired_h100": _prep_and_paired(FIXTURES / "prep_h100_resnet50_paired"),
        }
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        EXPECTED.write_text(json.dumps(compute_all(), indent=1, sort_keys=True) + "\n")
    else:
        print(json.dumps(compute_all(), indent=1, sort_keys=True))
