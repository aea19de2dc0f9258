"""Does `gpulens allocate-workers` beat an even split of loader CPUs across concurrent jobs?

1. Curves: each job alone at each worker count of --grid (`gpulens run JOB --data DIR --workers
   W`), stored in a private gpulens home so `allocate-workers` reads them as measured curves.
2. The allocation: `gpulens allocate-workers JOB... --cpus C --json` (with its even split).
3. The check: all jobs at once, with the allocation and with the even split, alternating ABBA
   over --repeats rounds; aggregate samples/s and normalized throughput (each job's rate over its
   best solo rate), the objective the allocation maximises. --pin gives each job its own block
   of CPUs (workers + its main process) with taskset, as a CPU quota would; without it the OS
   schedules all loaders on the shared CPUs.

Full JSON to $OUT/allocate_workers_gpu.json (or --out); a short table last on stdout.

    python benchmarks/allocate_workers_gpu.py --jobs resnet50,mobilenet_v3_small,resnet18 \\
        --cpus 12 --grid 1,2,4,8 --images 20000 --duration 30 --precision bf16 --pin
    # CPU check (tiny settings):
    python benchmarks/allocate_workers_gpu.py --jobs tiny_cnn,tiny_cnn --cpus 3 --grid 1,2 \\
        --images 64 --steps 4 --batch-size 8 --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


def gpulens(args: list[str], env: dict, cpus: list[int] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gpulens.cli", *args]
    if cpus:
        cmd = ["taskset", "-c", ",".join(map(str, cpus)), *cmd]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def finish(proc: subprocess.Popen, what: str) -> dict:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed ({proc.returncode}): {err.strip().splitlines()[-1:]}")
    return json.loads(out)


def run_args(a: argparse.Namespace, job: str, workers: int, name: str) -> list[str]:
    args = ["run", job, "--data", str(a.data), "--workers", str(workers), "--device", a.device,
            "--precision", a.precision, "--json", "--no-store", "--name", name]  # fmt: skip
    args += ["--steps", str(a.steps)] if a.steps else ["--duration", str(a.duration)]
    if a.batch_size:
        args += ["--batch-size", str(a.batch_size)]
    return args + ["--warmup-steps", str(a.warmup_steps)]


def blocks(sizes: list[int]) -> list[list[int]]:
    """Disjoint CPU blocks of the given sizes from this process's allowed CPUs."""
    allowed = sorted(os.sched_getaffinity(0))
    if sum(sizes) > len(allowed):
        raise SystemExit(f"--pin needs {sum(sizes)} CPUs, {len(allowed)} allowed")
    out, i = [], 0
    for n in sizes:
        out.append(allowed[i : i + n])
        i += n
    return out


def concurrent(a, jobs: list[str], workers: list[int], env: dict, tag: str) -> list[dict]:
    cpus = blocks([w + 1 for w in workers]) if a.pin else [None] * len(jobs)
    procs = [gpulens(run_args(a, j, w, f"{tag}-{i}-{j}"), env, c)
             for i, (j, w, c) in enumerate(zip(jobs, workers, cpus, strict=True))]  # fmt: skip
    return [finish(p, f"{tag} {j}") for p, j in zip(procs, jobs, strict=True)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", required=True, help="comma-separated workloads (2 or 3)")
    ap.add_argument("--cpus", type=int, required=True, help="loader CPUs for all jobs together")
    ap.add_argument("--grid", default="1,2,4,8", help="worker counts of the solo curves")
    ap.add_argument("--data", type=Path, default=None, help="an ImageFolder (else --images)")
    ap.add_argument("--images", type=int, default=20000, help="JPEGs to make without --data")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--duration", type=float, default=30.0, help="measured seconds per run")
    ap.add_argument("--steps", type=int, default=None, help="measured steps instead")
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2, help="ABBA rounds of the comparison")
    ap.add_argument("--pin", action="store_true", help="each job on its own CPU block")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    jobs, grid = a.jobs.split(","), [int(w) for w in a.grid.split(",")]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpulens-alloc-") as tmp:
        env = {**os.environ, "GPULENS_HOME": str(Path(tmp) / "home")}
        env.pop("MLFLOW_TRACKING_URI", None)
        if a.data is None:
            a.data = Path(tmp) / "images"
            finish(gpulens(["data", "make", "images", "--out", str(a.data), "--n",
                            str(a.images), "--json"], env), "data make")  # fmt: skip
        solo = []
        for job in dict.fromkeys(jobs):  # a job listed twice is measured once
            for w in grid:
                s = finish(gpulens(run_args(a, job, w, f"solo-{job}-w{w}"), env), f"{job} w{w}")
                rate = s["throughput_samples_per_s"]
                solo.append({"job": job, "workers": w, "samples_per_s": rate,
                             "ci95_pct": s.get("throughput_ci95_pct")})  # fmt: skip
                print(f"solo {job} w={w}: {s['throughput_samples_per_s']:.1f} samples/s",
                      file=sys.stderr, flush=True)  # fmt: skip
        plan = finish(gpulens(["allocate-workers", *jobs, "--cpus", str(a.cpus), "--json"], env),
                      "allocate-workers")  # fmt: skip
        arms = {"allocated": [j["workers"] for j in plan["jobs"]],
                "even": [j["even_workers"] for j in plan["jobs"]]}  # fmt: skip
        best = {j: max(r["samples_per_s"] for r in solo if r["job"] == j) for j in set(jobs)}
        rounds = []
        for r in range(a.repeats):
            order = ("allocated", "even") if r % 2 == 0 else ("even", "allocated")
            for arm in order:
                res = concurrent(a, jobs, arms[arm], env, f"r{r}-{arm}")
                rates = [x["throughput_samples_per_s"] for x in res]
                norm = sum(x / best[j] for x, j in zip(rates, jobs, strict=True))
                rounds.append({"round": r, "arm": arm, "workers": arms[arm],
                               "samples_per_s": rates, "aggregate_samples_per_s": sum(rates),
                               "normalized": norm})  # fmt: skip
                print(f"round {r} {arm}: {sum(rates):.1f} samples/s", file=sys.stderr, flush=True)
    summary = {}
    for arm in arms:
        mine = [x for x in rounds if x["arm"] == arm]
        summary[arm] = {
            "workers": arms[arm],
            "aggregate_samples_per_s": statistics.mean(x["aggregate_samples_per_s"] for x in mine),
            "normalized": statistics.mean(x["normalized"] for x in mine),
        }
    gain = 100 * (summary["allocated"]["normalized"] / summary["even"]["normalized"] - 1)
    doc = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "args": {k: str(v) for k, v in vars(a).items()}, "solo_curves": solo, "plan": plan,
           "rounds": rounds, "summary": summary, "measured_gain_pct": gain,
           "predicted_gain_pct": plan["aggregate"]["gain_pct"],
           "wall_s": time.perf_counter() - t0}  # fmt: skip
    out = a.out or Path(os.environ.get("OUT", "benchmarks/results"), "allocate_workers_gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"{'arm':<10} {'workers':<14} {'samples/s':>10} {'normalized':>10}")
    for arm, s in summary.items():
        print(f"{arm:<10} {str(s['workers']):<14} {s['aggregate_samples_per_s']:>10.1f} "
              f"{s['normalized']:>10.3f}")  # fmt: skip
    print(f"gain {gain:+.1f}% measured, {doc['predicted_gain_pct']:+.1f}% predicted; {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
