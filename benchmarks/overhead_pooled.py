"""Pools several ``overhead_interleaved.py`` results: one ratio per GPU, case and arm (issue 19).

The cost of measuring a launch-bound loop differs from one machine of a kind to the next by
more than one run's interval (H200 batch 1, ``full``: 0.979 on one machine, 0.998 on another),
so one run cannot say what a user will meet. Here every run's pairs count alike: the pooled
ratio is plain time over instrumented time over all pairs of all runs, and its 95% interval
resamples pairs within each run (the runs stay as they are: each machine is kept).

``median_pair_ratio`` is the median over all pairs of plain / instrumented chunk time, with the
same resampling: the typical pair, robust to a noisy host's stalls, which hit both arms alike
there. It also hides a stall that gpulens itself causes, so the steps over 3x the median are
counted per arm (``stalls_plain``, ``stalls_instrumented``) beside it.

    python benchmarks/overhead_pooled.py results/overhead_interleaved-*.json [--out pooled.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

BOOTSTRAP = 4000


def load_runs(paths: list[Path]) -> dict[tuple[str, str, str], list[dict]]:
    """``(gpu, case, arm) -> [run]``, each run with its file and per-pair chunk means (ms)."""
    runs: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for path in paths:
        doc = json.loads(path.read_text())
        for case, arms in doc["cases"].items():
            for arm, r in arms.items():
                if "pair_plain_step_ms" not in r:
                    continue  # written before pairs were kept: nothing to pool
                runs[(doc["gpu"], case, arm)].append(
                    {
                        "file": path.name,
                        "ratio": r["ratio"],
                        "stalls": (
                            len(r.get("stalls_plain", [])),
                            len(r.get("stalls_instrumented", [])),
                        ),
                        "plain": np.asarray(r["pair_plain_step_ms"], dtype=float),
                        "instrumented": np.asarray(r["pair_instrumented_step_ms"], dtype=float),
                    }
                )
    return runs


def pool(runs: list[dict], seed: int = 0) -> dict:
    """Pooled ratio (plain / instrumented time over every pair) and its interval, resampling
    pairs within each run."""
    rng = np.random.default_rng(seed)
    plain = sum(float(r["plain"].sum()) for r in runs)
    inst = sum(float(r["instrumented"].sum()) for r in runs)
    boot_plain = np.zeros(BOOTSTRAP)
    boot_inst = np.zeros(BOOTSTRAP)
    pair_ratios = [r["plain"] / r["instrumented"] for r in runs]
    boot_pairs = []
    for r, pr in zip(runs, pair_ratios, strict=True):
        picks = rng.integers(0, len(r["plain"]), size=(BOOTSTRAP, len(r["plain"])))
        boot_plain += r["plain"][picks].sum(axis=1)
        boot_inst += r["instrumented"][picks].sum(axis=1)
        boot_pairs.append(pr[picks])
    lo, hi = np.quantile(boot_plain / boot_inst, [0.025, 0.975])
    boot_median = np.median(np.concatenate(boot_pairs, axis=1), axis=1)
    med_lo, med_hi = np.quantile(boot_median, [0.025, 0.975])
    return {
        "runs": len(runs),
        "pairs": int(sum(len(r["plain"]) for r in runs)),
        "ratio": round(plain / inst, 4),
        "ratio_ci95": [round(float(lo), 4), round(float(hi), 4)],
        "median_pair_ratio": round(float(np.median(np.concatenate(pair_ratios))), 4),
        "median_pair_ratio_ci95": [round(float(med_lo), 4), round(float(med_hi), 4)],
        "stalls_plain": sum(r["stalls"][0] for r in runs),
        "stalls_instrumented": sum(r["stalls"][1] for r in runs),
        "run_ratios": [r["ratio"] for r in runs],
        "files": [r["file"] for r in runs],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="overhead_interleaved JSON files")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    missing = [str(p) for p in args.results if not p.is_file()]
    if missing:
        ap.error(f"no such file: {missing[0]}")
    pooled = {
        f"{gpu} | {case} | {arm}": pool(runs)
        for (gpu, case, arm), runs in sorted(load_runs(args.results).items())
    }
    if args.out:
        doc = {
            "benchmark": "overhead_pooled",
            "command": " ".join(["python", *sys.argv]),
            "pooled": pooled,
        }
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(
        f"{'gpu | case | arm':<44} {'runs':>4} {'pairs':>6} {'ratio':>7} {'95% interval':>17} "
        f"{'median':>7} {'95% interval':>17} {'stalls':>7}  runs"
    )
    for key, p in pooled.items():
        lo, hi = p["ratio_ci95"]
        mlo, mhi = p["median_pair_ratio_ci95"]
        each = " ".join(f"{x:.3f}" for x in p["run_ratios"])
        print(
            f"{key:<44} {p['runs']:>4} {p['pairs']:>6} {p['ratio']:7.4f} "
            f"[{lo:.4f}, {hi:.4f}] {p['median_pair_ratio']:7.4f} [{mlo:.4f}, {mhi:.4f}] "
            f"{p['stalls_plain']:>3}/{p['stalls_instrumented']:<3}  {each}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
