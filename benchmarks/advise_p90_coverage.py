"""How often a measured time stays within `gpulens advise`'s p90, on the committed validation.

advise spreads each predicted time by its prediction's error (``p90_error_pct``, read as normal
errors of that mean absolute size; ``gpulens.predict.advise``). A p90 is right when about 90%
of measured times fall at or under it: well above, it is too wide to be of use; below, a
deadline met at p90 is missed more often than the user was told. This scores that rule on the
scored cases already committed (no GPU needed):

- cross-GPU: ``predict_validation-...-six_ladders-*.json`` (one-GPU H100 <-> H200, kernel
  method), the GPU-bound ones at their validated error and all of them at the error assumed
  where none was validated (``validation.ASSUMED_ERROR``);
- same GPU: ``predict_same_gpu-twenty_two_ladders-*.json`` (batch sizes by regime, 1 -> 2 GPUs,
  with session 33's H200 pair, ``predict_same_gpu-1455e5d-*-gpu_paced_pairs-*.json``),
  ``predict_same_gpu-ebb5908-NVIDIA_H200-x4-*.json`` and session 34's
  ``predict_same_gpu-b543435-NVIDIA_H200-x4-*.json`` (1 -> 4 GPUs; the second's 1 -> 2 too) and
  ``predict_same_gpu-workers-seventeen_ladders-*.json`` (loader workers), each at the figure
  ``predict`` quotes for its regime.

    python benchmarks/advise_p90_coverage.py --out benchmarks/results/advise_p90_coverage-<day>.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gpulens.predict.advise import Z_P90, error_sigma  # noqa: E402
from gpulens.predict.validation import ASSUMED_ERROR, VALIDATED  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CROSS = "predict_validation-H100_H200-records_and_ladders-six_ladders-2026-11-26.json"
SAME = "predict_same_gpu-twenty_two_ladders-H100_H200-2026-11-27.json"
WORKERS = "predict_same_gpu-workers-seventeen_ladders-H100_H200-2026-11-27.json"
FOUR = "predict_same_gpu-ebb5908-NVIDIA_H200-x4-2026-11-28.json"
FOUR_AGAIN = "predict_same_gpu-b543435-NVIDIA_H200-x4-2026-11-28.json"
PAIR = "predict_same_gpu-1455e5d-NVIDIA_H200-x2-gpu_paced_pairs-2026-11-28.json"


def _ratio(case: dict) -> float:
    """Measured time over predicted time (the inverse of the throughputs')."""
    return case["predicted_samples_per_s"] / case["measured_samples_per_s"]


def groups() -> dict[str, tuple[float, list[float], str]]:
    """Group name -> (error % spread into the p90, measured/predicted time ratios, file)."""
    cross = json.loads((RESULTS / CROSS).read_text())["cases"]
    one_gpu = [c for c in cross if c["gpus"] == 1 and "source_gpu_busy" in c]
    busy = [c for c in one_gpu if min(c["source_gpu_busy"], c["target_gpu_busy"]) >= 0.8]
    out = {
        "cross-GPU, both GPU-bound (validated)": (
            VALIDATED["kernel_roofline"].mape_pct, [_ratio(c) for c in busy], CROSS),
        "cross-GPU, all (at the assumed error)": (
            ASSUMED_ERROR.mape_pct, [_ratio(c) for c in one_gpu], CROSS),
    }  # fmt: skip
    same = json.loads((RESULTS / SAME).read_text())
    for regime in ("batch_up", "batch_up_host_bound", "batch_down_probed", "batch_down"):
        cases = [c for c in same["batch_cases"] if c["regime"] == regime]
        out[f"same GPU, {regime}"] = (VALIDATED[regime].mape_pct, [_ratio(c) for c in cases], SAME)
    pair = json.loads((RESULTS / PAIR).read_text())["gpus_cases"]
    four_again = json.loads((RESULTS / FOUR_AGAIN).read_text())
    for host_paced, regime in ((False, "multi_gpu_same_gpu"), (True, "multi_gpu_host_paced")):
        cases = [c for c in same["gpus_cases"] + pair + four_again["gpus_cases"]
                 if c["host_paced"] == host_paced]  # fmt: skip
        out[f"1 -> 2 GPUs, {regime}"] = (
            VALIDATED[regime].mape_pct, [_ratio(c) for c in cases],
            f"{SAME} + {PAIR} + {FOUR_AGAIN}")  # fmt: skip
    four = json.loads((RESULTS / FOUR).read_text())["gpus_more_cases"]
    for host_paced, regime in ((False, "multi_gpu_same_gpu"), (True, "multi_gpu_host_paced")):
        cases = [c for c in four + four_again["gpus_more_cases"]
                 if c["host_paced"] == host_paced and c["to_gpus"] == 4]  # fmt: skip
        pct = max(VALIDATED[regime].mape_pct, VALIDATED["multi_gpu_four"].mape_pct)
        out[f"1 -> 4 GPUs, {regime}"] = (pct, [_ratio(c) for c in cases], f"{FOUR} + {FOUR_AGAIN}")
    workers = json.loads((RESULTS / WORKERS).read_text())["worker_run_cases"]
    out["loader workers"] = (VALIDATED["workers"].mape_pct, [_ratio(c) for c in workers], WORKERS)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the table as JSON here")
    args = parser.parse_args(argv)
    rows = []
    for name, (pct, ratios, source) in groups().items():
        p90 = float(np.exp(Z_P90 * error_sigma(pct)))
        r = np.asarray(ratios)
        rows.append({"group": name, "error_pct": pct, "p90_factor": round(p90, 4),
                     "cases": len(r), "held_share": round(float(np.mean(r <= p90)), 4),
                     "measured_p90_ratio": round(float(np.percentile(r, 90)), 4),
                     "median_ratio": round(float(np.median(r)), 4), "source": source})  # fmt: skip
    total = sum(row["cases"] for row in rows[1:])  # the assumed-error row repeats the first's
    held = sum(row["held_share"] * row["cases"] for row in rows[1:])
    print(f"{'group':42} {'error':>6} {'p90 x':>6} {'cases':>6} {'held':>6} {'meas. p90':>9}")
    for row in rows:
        print(
            f"{row['group']:42} {row['error_pct']:6.1f} {row['p90_factor']:6.3f} "
            f"{row['cases']:6d} {row['held_share']:6.1%} {row['measured_p90_ratio']:9.3f}"
        )
    print(f"all but the first row: {held / total:.1%} of {total} measured times within the p90")
    if args.out:
        doc = {
            "command": f"python benchmarks/advise_p90_coverage.py --out {args.out}",
            "rule": "p90 = prediction x exp(z90 x sqrt(pi/2) x error_pct/100)",
            "groups": rows,
            "held_share_all": round(held / total, 4),
            "cases_all": total,
        }
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
