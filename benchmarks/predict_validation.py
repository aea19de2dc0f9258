"""Cross-GPU validation of `gpulens predict`: each GPU's runs predicted from the other's.

    python benchmarks/predict_validation.py [RUNS ...] [--out FILE.json]

RUNS are run directories, folders of runs, or .tgz/.tar.xz files of them. Runs of the same workload,
batch size, precision, data role (ingestion-free / cached / cold / train), loader workers and
GPU count measured on two GPU models are predicted from each other; the table gives each case's
predicted and measured throughput and the mean absolute percentage error (MAPE) per workload.

Without RUNS it uses what is committed: the record tarballs in benchmarks/results (the stall
sessions' H100 records, and `predict-records-*.tar.xz`: five workloads at two batch sizes with
profiler windows, on an H100 and on an H200), the records under tests/fixtures, and the H200
throughputs of the `gpulens stalls` JSONs in benchmarks/results (stalls-defaults-*-NVIDIA_H200*,
stalls-2gpu-*-NVIDIA_H200x2*).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

from gpulens.errors import UsageError
from gpulens.predict import roofline
from gpulens.predict.catalog import find_gpu
from gpulens.predict.features import run_facts
from gpulens.predict.predictor import Target, predict_run
from gpulens.predict.trace import read_kernels
from gpulens.predict.validation import ape_pct, mape_pct
from gpulens.record.reader import list_records, read_record

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# Loader-bound throughput depends on the host's CPUs and the dataset, not on the GPU.
LOADER_ROLES = ("cached", "cold", "paired_cold", "train")


def _role(meta: dict) -> str:
    eff = meta.get("effective_config") or {}
    if eff.get("data") == "synthetic":
        return "ingestion_free"
    name = str(meta.get("name") or "")
    for role in ("paired_cold", "cached", "cold"):
        if name.endswith(role):
            return role
    return "train"


def _key(workload, batch, precision, role, workers, gpus) -> tuple:
    return (
        workload,
        int(batch),
        precision,
        role,
        int(workers) if role in LOADER_ROLES else 0,
        gpus,
    )


def load_records(paths: list[Path], tmp: Path) -> list:
    out = []
    for i, path in enumerate(paths):
        if path.name.endswith((".tgz", ".tar.gz", ".tar.xz")):
            dest = tmp / f"{i}"
            with tarfile.open(path) as tar:
                tar.extractall(dest, filter="data")
            path = dest
        if (path / "run.json").is_file():
            out.append(read_record(path))
        else:
            out += list_records(path) + list_records(path / "runs")
    seen, unique = set(), []
    for rec in out:
        s = rec.meta.get("summary") or {}
        if rec.status == "finished" and s.get("phases_s") and rec.run_id not in seen:
            seen.add(rec.run_id)
            unique.append(rec)
    return unique


def record_point(rec) -> dict:
    s = rec.meta["summary"]
    name = (s.get("gpu") or {}).get("name") or rec.meta["environment"]["gpu_model"]
    gpu = find_gpu(name, recorded=True).gpu
    key = _key(s["workload"], s["batch_size"], s["precision"], _role(rec.meta), s.get("workers"),
               s.get("gpus") or 1)  # fmt: skip
    cpus = (rec.meta.get("environment") or {}).get("cpu_count_logical")
    return {"gpu": gpu, "key": key, "tput": s["throughput_samples_per_s"], "cpus": cpus,
            "record": rec, "source": rec.run_id}  # fmt: skip


def committed_points() -> list[dict]:
    """Throughputs measured on H200 (no records committed) from the stalls JSONs."""
    from gpulens.workloads.models import get_workload

    points = []
    files = sorted(RESULTS.glob("stalls-defaults-*NVIDIA_H200*.json"))
    files += sorted(RESULTS.glob("stalls-2gpu-*NVIDIA_H200x2*.json"))
    for f in files:
        doc = json.loads(f.read_text())
        res, cmd = doc["result"], doc["command"]
        opt = dict(re.findall(r"--(precision|workers|batch-size)\s+(\S+)", cmd))
        workload = res["workload"]
        batch = int(opt.get("batch-size") or get_workload(workload).default_batch_size)
        cores = re.search(r"(\d+) cores", doc.get("machine") or "")
        for role, tput in res["throughput_samples_per_s"].items():
            if tput is None or role in ("cold", "multi_gpu_socket"):
                continue  # cold: the disk's; socket: a transport no record here used
            gpus = 2 if role == "multi_gpu" else 1
            r = "ingestion_free" if role == "multi_gpu" else role
            key = _key(
                workload, batch, opt.get("precision", "fp32"), r, opt.get("workers", 0), gpus
            )
            points.append({"gpu": "H200", "key": key, "tput": tput, "record": None,
                           "cpus": int(cores.group(1)) if cores else None,
                           "source": f.name})  # fmt: skip
    return points


def kernel_time_case(src_rec, truth_rec, src_gpu: str, tgt_gpu: str) -> dict | None:
    """The GPU model alone, without either host: the source's profiled kernel time per step
    scaled to the target against the target's own profiled kernel time per step."""
    a, b = run_facts(src_rec), run_facts(truth_rec)
    if a.trace is None or b.trace is None or not a.trace_steps or not b.trace_steps:
        return None
    column = roofline.peak_column(a.precision, a.workload)
    src, tgt = (roofline.hardware(find_gpu(g), column) for g in (src_gpu, tgt_gpu))
    scaled = roofline.scale_kernels(read_kernels(a.trace), a.trace_steps, src, tgt)
    measured_s = sum(k.duration_s for k in read_kernels(b.trace)) / b.trace_steps
    return {
        # the share of each run's step its GPU spent in kernels: below 0.8 the host set the pace
        "source_gpu_busy": scaled.busy_s_per_step / (a.step_s - a.data_wait_s),
        "target_gpu_busy": measured_s / (b.step_s - b.data_wait_s),
        "source_kernel_ms_per_step": 1e3 * scaled.busy_s_per_step,
        "predicted_kernel_ms_per_step": 1e3 * scaled.scaled_s_per_step,
        "measured_kernel_ms_per_step": 1e3 * measured_s,
        "kernel_ape_pct": ape_pct(scaled.scaled_s_per_step, measured_s),
        "naive_kernel_ape_pct": ape_pct(scaled.busy_s_per_step, measured_s),
    }


def without_window(rec):
    """The record as one without a profiler window: what `predict` does for such a run (the
    whole-step method) scored on the same cases."""
    meta = {k: v for k, v in rec.meta.items() if k != "torch_profiler"}
    return SimpleNamespace(meta=meta, dir=rec.dir, status=rec.status, run_id=rec.run_id)


def cases(points: list[dict], no_window: bool = False) -> list[dict]:
    """Every record on one GPU predicting every measurement of the same key on another GPU
    (and, for a 1-GPU record, the same key at 2 GPUs); ``no_window``: each source read as
    if it had no profiler window."""
    out = []
    by_key = defaultdict(list)
    for p in points:
        by_key[p["key"]].append(p)
    for src in (p for p in points if p["record"] is not None and p["key"][5] == 1):
        for gpus in (1, 2):
            key = src["key"][:5] + (gpus,)
            for truth in by_key.get(key, []):
                if truth["gpu"] == src["gpu"]:
                    continue
                cpus_differ = truth["cpus"] and src["cpus"] and truth["cpus"] != src["cpus"]
                if key[3] in LOADER_ROLES and cpus_differ:
                    continue  # a loader-bound run on a host with other CPUs: not comparable
                try:
                    source = without_window(src["record"]) if no_window else src["record"]
                    pred = predict_run(source, Target(truth["gpu"], gpus))
                except UsageError as exc:
                    print(f"skipped {src['source']}: {exc}", file=sys.stderr)
                    continue
                out.append({
                    "workload": key[0], "batch_size": key[1], "precision": key[2],
                    "role": key[3], "workers": key[4], "gpus": gpus,
                    "from": f"{src['gpu']} {src['source']}",
                    "to": f"{truth['gpu']} {truth['source']}",
                    "method": pred.method, "regimes": list(pred.regimes),
                    "predicted_samples_per_s": pred.throughput_samples_per_s,
                    "measured_samples_per_s": truth["tput"],
                    "source_samples_per_s": src["tput"],
                    "ape_pct": ape_pct(pred.throughput_samples_per_s, truth["tput"]),
                    # What "no change" would have scored: the bar a model has to clear.
                    "naive_ape_pct": ape_pct(src["tput"] * gpus, truth["tput"]),
                })  # fmt: skip
                if gpus == 1 and truth["record"] is not None:
                    out[-1].update(kernel_time_case(src["record"], truth["record"],
                                                    src["gpu"], truth["gpu"]) or {})  # fmt: skip
    return out


def ring_cases() -> list[dict]:
    """The ring all-reduce model alone, from the committed 2-GPU stalls JSONs: the measured
    1-GPU step plus the modelled all-reduce against the measured 2-GPU DDP step (same host)."""
    from gpulens.predict.communication import communication
    from gpulens.predict.features import model_size
    from gpulens.workloads.models import get_workload

    out = []
    for f in sorted(RESULTS.glob("stalls-2gpu-*NVIDIA_H200x2*.json")):
        doc = json.loads(f.read_text())
        res = doc["result"]
        tput = res["throughput_samples_per_s"]
        batch = get_workload(res["workload"]).default_batch_size
        spec = find_gpu("H200")
        comm = communication(model_size(res["workload"])[0], None, [], spec)
        step_1 = batch / tput["ingestion_free"]
        predicted = 2 * batch / (step_1 + comm.exposed_s(spec, 2))
        out.append(
            {
                "workload": res["workload"],
                "file": f.name,
                "one_gpu": tput["ingestion_free"],
                "predicted_two_gpu": predicted,
                "measured_two_gpu": tput["multi_gpu"],
                "ape_pct": ape_pct(predicted, tput["multi_gpu"]),
                "naive_ape_pct": ape_pct(2 * tput["ingestion_free"], tput["multi_gpu"]),
            }
        )
    return out


def summarize(rows: list[dict]) -> dict:
    groups = defaultdict(list)
    for r in rows:
        kind = "gpu_bound" if r["role"] == "ingestion_free" else "loader_bound"
        groups[(r["workload"], kind, r["gpus"])].append(r)
    table = {}
    for (workload, kind, gpus), rs in sorted(groups.items()):
        table[f"{workload} {kind} {gpus}gpu"] = {
            "cases": len(rs),
            "mape_pct": mape_pct(
                [(r["predicted_samples_per_s"], r["measured_samples_per_s"]) for r in rs]
            ),  # fmt: skip
            "naive_mape_pct": statistics.mean(r["naive_ape_pct"] for r in rs),
        }
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--no-window",
        action="store_true",
        help="predict each source as if it had no profiler window (the whole-step method)",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = args.runs or sorted(RESULTS.glob("stalls-resnet50*records*.tgz")) + sorted(
            RESULTS.glob("predict-records-*.tar.xz")
        ) + [p.parent for p in sorted((ROOT / "tests" / "fixtures").glob("**/run.json"))]
        records = load_records(paths, Path(tmp))
        points = []
        for rec in records:
            try:
                points.append(record_point(rec))
            except (KeyError, TypeError, UsageError):
                continue
        if not args.runs:
            points += committed_points()
        rows = cases(points, args.no_window)
    print(f"{'case':<52} {'method':<20} {'pred':>8} {'meas':>8} {'err%':>6} {'naive%':>7}")
    for r in rows:
        case = f"{r['workload']} b{r['batch_size']} {r['role']} w{r['workers']} -> {r['to'][:24]}"
        pred, meas = r["predicted_samples_per_s"], r["measured_samples_per_s"]
        errors = f"{r['ape_pct']:6.1f} {r['naive_ape_pct']:7.1f}"
        print(f"{case:<52} {r['method']:<20} {pred:8.0f} {meas:8.0f} {errors}")
    table = summarize(rows)
    print("\nMAPE per workload (throughput; naive = the source GPU's measured figure unchanged):")
    for name, t in table.items():
        print(f"  {name:<36} {t['cases']:3d} cases  MAPE {t['mape_pct']:5.1f}%  "
              f"naive {t['naive_mape_pct']:5.1f}%")  # fmt: skip
    gpu_bound = [r for r in rows if r["role"] == "ingestion_free" and r["gpus"] == 1]
    overall = mape_pct([(r["predicted_samples_per_s"], r["measured_samples_per_s"])
                        for r in gpu_bound])  # fmt: skip
    kernel_rows = [r for r in gpu_bound if "kernel_ape_pct" in r]
    if kernel_rows:
        mean = statistics.mean
        print(
            f"\nGPU kernel time per step alone (no host): MAPE "
            f"{mean(r['kernel_ape_pct'] for r in kernel_rows):.1f}% (max "
            f"{max(r['kernel_ape_pct'] for r in kernel_rows):.1f}%), unchanged "
            f"{mean(r['naive_kernel_ape_pct'] for r in kernel_rows):.1f}%, over "
            f"{len(kernel_rows)} cases"
        )
    # Both GPUs busy >= 80% of their steps: what a GPU model can be held to. Below, the
    # step is the host's (its CPU, its Python), which differs between the two machines.
    both_busy = [r for r in kernel_rows if min(r["source_gpu_busy"], r["target_gpu_busy"]) >= 0.8]
    gpu_bound_both = mape_pct([(r["predicted_samples_per_s"], r["measured_samples_per_s"])
                               for r in both_busy])  # fmt: skip
    if both_busy:
        naive = statistics.mean(r["naive_ape_pct"] for r in both_busy)
        print(
            f"both GPUs busy >= 80% of the step: throughput MAPE {gpu_bound_both:.1f}% "
            f"(unchanged {naive:.1f}%) over {len(both_busy)} of {len(kernel_rows)} profiled cases"
        )
    ring = [] if args.runs else ring_cases()
    if ring:
        print("\nring all-reduce alone (H200 x2, NVLink): measured 1-GPU step + model vs 2 GPUs")
        for r in ring:
            print(
                f"  {r['workload']:<10} 1 GPU {r['one_gpu']:7.0f}  2 GPUs predicted "
                f"{r['predicted_two_gpu']:7.0f} measured {r['measured_two_gpu']:7.0f}  "
                f"err {r['ape_pct']:4.1f}%  (perfect scaling: {r['naive_ape_pct']:4.1f}%)"
            )
    pairs = {(r["from"].split()[0], r["to"].split()[0]) for r in rows}
    print(
        f"\ncross-GPU, GPU-bound, 1 GPU: MAPE {overall}% over {len(gpu_bound)} cases; "
        f"directions {sorted(pairs)}; workloads {sorted({r['workload'] for r in rows})}"
    )
    if args.out:
        doc = {
            "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "gpu_bound_1gpu_mape_pct": overall,
            "both_gpus_busy_mape_pct": gpu_bound_both,
            "both_gpus_busy_cases": len(both_busy),
            "kernel_time_mape_pct": statistics.mean(r["kernel_ape_pct"] for r in kernel_rows)
            if kernel_rows
            else None,
            "directions": sorted(pairs),
            "mape": table,
            "ring_allreduce_cases": ring,
            "cases": rows,
        }
        args.out.write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
