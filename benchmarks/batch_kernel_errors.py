"""The batch model's error on GPU kernel time alone, free of the host (issue 17).

    python benchmarks/batch_kernel_errors.py LADDER.tar.xz [...]

Every profiled 1-GPU run of a ladder (`benchmarks/predict_ladder.sh`) predicts the kernel time
per step of every other run of its workload at another batch size on the same machine, by
`gpulens.predict.batch.scale_batch`; the measured figure is that run's own profiler window.
Prints the mean absolute error per ladder and over all, growing and shrinking the batch apart.
It is the figure a model change should move: throughput errors (`predict_same_gpu.py`) also
carry the host's pace, which differs from run to run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from predict_validation import load_records

from gpulens.errors import UsageError
from gpulens.predict.batch import scale_batch
from gpulens.predict.catalog import find_gpu
from gpulens.predict.features import run_facts
from gpulens.predict.roofline import hardware, peak_column


def profiled_runs(ladder: Path, into: Path) -> list:
    """The facts of a ladder's finished, profiled 1-GPU runs."""
    runs = []
    for rec in load_records([ladder], into):
        try:
            facts = run_facts(rec)
        except UsageError:
            continue
        if facts.trace is not None and facts.trace_steps > 0 and facts.gpus == 1:
            runs.append(facts)
    return runs


def ladder_errors(runs: list) -> dict[str, list[float]]:
    """Signed errors (%) of the predicted kernel time per step, by direction."""
    out: dict[str, list[float]] = {"up": [], "down": []}
    for src in runs:
        hw = hardware(
            find_gpu(src.gpu_name, recorded=True), peak_column(src.precision, src.workload)
        )
        for dst in runs:
            if dst.workload != src.workload or dst.batch_size == src.batch_size:
                continue
            pred = scale_batch(src.trace, src.trace_steps, src.batch_size, dst.batch_size, hw)
            meas = scale_batch(dst.trace, dst.trace_steps, dst.batch_size, dst.batch_size, hw)
            err = 100 * (pred.scaled_s_per_step / meas.busy_s_per_step - 1)
            out["up" if dst.batch_size > src.batch_size else "down"].append(err)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ladders", nargs="+", type=Path)
    args = ap.parse_args()
    total: dict[str, list[float]] = {"up": [], "down": []}
    print(f"{'ladder':<60} {'larger batch':>18} {'smaller batch':>18}")
    for ladder in args.ladders:
        with tempfile.TemporaryDirectory() as tmp:
            errs = ladder_errors(profiled_runs(ladder, Path(tmp)))
        cells = []
        for way in ("up", "down"):
            total[way] += errs[way]
            xs = [abs(e) for e in errs[way]]
            cells.append(f"{statistics.fmean(xs):5.1f}% ({len(xs):3d})" if xs else "-")
        print(f"{ladder.name[:60]:<60} {cells[0]:>18} {cells[1]:>18}")
    for way in ("up", "down"):
        xs = [abs(e) for e in total[way]]
        if xs:
            print(
                f"all, {way:<4}: kernel time MAPE {statistics.fmean(xs):.2f}% over {len(xs)} cases"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
