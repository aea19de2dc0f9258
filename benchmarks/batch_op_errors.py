"""Per op, where `gpulens predict --batch-size` errs: one run's profiler window scaled by the
batch model to another run's batch, against that run's own window (same GPU, same workload).

    python benchmarks/batch_op_errors.py SOURCE_RUN_DIR TARGET_RUN_DIR [--top 14]

Run directories as `benchmarks/predict_ladder.sh` writes them (each with torch_trace.json and a
`--torch-profiler` window); unpack a committed predict-ladder-*.tar.xz to get them.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from gpulens.predict import batch as batch_model
from gpulens.predict.catalog import find_gpu
from gpulens.predict.features import run_facts
from gpulens.predict.roofline import hardware, peak_column
from gpulens.predict.trace import load_trace
from gpulens.record.reader import read_record


def per_op_ms(run_dir: Path, new_batch: int) -> dict[str, tuple[float, float]]:
    """Op name -> (measured, modelled at ``new_batch``) kernel ms per profiled step."""
    facts = run_facts(read_record(run_dir))
    hw = hardware(
        find_gpu(facts.gpu_name, recorded=True), peak_column(facts.precision, facts.workload)
    )
    ops, kernels = load_trace(facts.trace)
    sizes = batch_model.batch_sizes(ops.values(), facts.batch_size)
    factor = new_batch / facts.batch_size
    ratios: dict[object, float | None] = {}
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for k in kernels:
        t = float(k["dur"]) * 1e-6
        ext = (k.get("args") or {}).get("External id")
        if ext not in ratios:
            ratios[ext] = batch_model.op_ratio(ops.get(ext), sizes, factor, hw)
        name = (ops.get(ext) or {}).get("name", "(no op)")
        totals[name][0] += t
        totals[name][1] += batch_model.scaled_kernel_s(t, ratios[ext] or 1.0)
    steps = facts.trace_steps
    return {n: (m / steps * 1e3, p / steps * 1e3) for n, (m, p) in totals.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("target", type=Path)
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    target_batch = run_facts(read_record(args.target)).batch_size
    source = per_op_ms(args.source, target_batch)
    target = per_op_ms(args.target, target_batch)
    names = sorted(set(source) | set(target), key=lambda n: -source.get(n, (0, 0))[1])
    print(f"{'op':<44} {'source ms':>9} {'predicted':>9} {'measured':>9}")
    for n in names[: args.top]:
        s, p = source.get(n, (0.0, 0.0))
        print(f"{n[:44]:<44} {s:9.2f} {p:9.2f} {target.get(n, (0.0, 0.0))[0]:9.2f}")
    total = [sum(v[i] for v in source.values()) for i in (0, 1)]
    measured = sum(v[0] for v in target.values())
    print(f"{'all kernels':<44} {total[0]:9.2f} {total[1]:9.2f} {measured:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
