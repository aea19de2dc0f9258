"""Same-GPU validation of `gpulens predict` (issue 17): another batch size, and 2 GPUs from 1.

    python benchmarks/predict_same_gpu.py RUNS.tar.xz [...] [--out FILE.json]

RUNS are run directories, folders of runs, or .tgz/.tar.xz files of them, as
`benchmarks/predict_ladder.sh` bundles them. Batch: every profiled 1-GPU run predicts every run
of the same workload, precision and GPU at another batch size (`predict --batch-size`). Cases
whose target batch is one of the sizes the model was designed on (those of predict_session.sh,
DESIGN_SIZES) are in-sample; the others (half the smaller, twice the larger) are held out.
GPUs: each 1-GPU run predicts the 2-GPU DDP run of the same workload and batch measured beside
it, with an empty store (the all-reduce model uncalibrated, as a new user's first prediction).
"Naive" is the source's throughput unchanged (batch) or doubled (2 GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from predict_validation import load_records

from gpulens.errors import UsageError
from gpulens.predict.batch import launch_gaps_s
from gpulens.predict.features import run_facts
from gpulens.predict.predictor import GPU_BOUND_FILL, Target, predict_run
from gpulens.predict.trace import load_trace
from gpulens.predict.validation import ape_pct

# The batch sizes of benchmarks/predict_session.sh, on whose H100/H200 records the batch model
# (batch.py: which dimensions carry the batch, the launch floor) was chosen.
DESIGN_SIZES = {
    "resnet18": (128, 256),
    "resnet50": (64, 128),
    "vgg16": (32, 64),
    "vit_b_16": (32, 64),
    "gpt2": (4, 8),
}


def _point(rec) -> dict | None:
    try:
        f = run_facts(rec)
    except UsageError:
        return None
    s = rec.meta["summary"]
    profiled = f.trace is not None and f.trace_steps > 0
    kernel_s = gap_s = None  # the GPU's kernel time and queued gaps per step (profiler window)
    if profiled:
        _, device = load_trace(f.trace)
        kernel_s = sum(float(e["dur"]) for e in device) * 1e-6 / f.trace_steps
        gap_s = launch_gaps_s(device) / f.trace_steps
    return {
        "record": rec,
        "run_id": f.run_id,
        "gpu": f.gpu_name,
        "key": (f.workload, f.precision, f.synthetic_data),
        "batch": f.batch_size,
        "gpus": f.gpus,
        "workers": f.workers,
        "profiled": profiled,
        "tput": float(s["throughput_samples_per_s"]),
        "ci95_pct": s.get("throughput_ci95_pct"),  # the run's own 95% interval over its steps
        "step_s": f.step_s,
        "compute_s": f.compute_s,
        "kernel_s": kernel_s,
        "gap_s": gap_s,
        "host_issue_s": f.host_issue_s,
    }


def batch_cases(points: list[dict]) -> list[dict]:
    groups = defaultdict(list)
    for p in points:
        if p["gpus"] == 1:  # runs of one machine and session (one ladder) predict each other
            groups[(p["gpu"], *p["key"], p["origin"])].append(p)
    rows = []
    for (gpu, workload, *_), ps in sorted(groups.items(), key=lambda kv: str(kv[0])):
        design = DESIGN_SIZES.get(workload, ())
        for src in (p for p in ps if p["profiled"]):
            for tgt in ps:
                if tgt["batch"] == src["batch"]:
                    continue
                try:
                    pred = predict_run(src["record"], Target(None, batch_size=tgt["batch"]))
                except UsageError as exc:
                    print(f"skipped {src['run_id']}: {exc}", file=sys.stderr)
                    continue
                held_out = tgt["batch"] not in design
                rows.append({
                    "gpu": gpu, "workload": workload, "origin": src["origin"],
                    "from_batch": src["batch"], "to_batch": tgt["batch"],
                    "factor": tgt["batch"] / src["batch"],
                    "set": "held_out" if held_out and src["batch"] in design
                    else "in_sample" if not held_out and src["batch"] in design else "other",
                    "from": src["run_id"], "to": tgt["run_id"],
                    "predicted_samples_per_s": pred.throughput_samples_per_s,
                    "measured_samples_per_s": tgt["tput"],
                    "source_samples_per_s": src["tput"],
                    "ape_pct": ape_pct(pred.throughput_samples_per_s, tgt["tput"]),
                    "naive_ape_pct": ape_pct(src["tput"], tgt["tput"]),
                    "source_host_issue_s": src["host_issue_s"],
                    "source_ci95_pct": src["ci95_pct"],
                    "target_ci95_pct": tgt["ci95_pct"],
                    "target_kernel_share": _kernel_share(tgt),
                    "target_gpu_fill": _gpu_fill(tgt),
                    # the batch regime the prediction weighed its validated error on
                    "regime": next((g for g in pred.regimes if g.startswith("batch_")), None),
                    "notes": list(pred.notes),
                })  # fmt: skip
    return rows


def averaged_cases(rows: list[dict], sizes: tuple[str, str] = ("from_batch", "to_batch")):
    """Changes between configurations each run more than once on one ladder (REPEATS), scored
    as a protocol of repeated runs would: the median prediction from every run of the source
    configuration against the median of every run of the target (for two runs, their means;
    `mean_ape_pct` scores the means). Against the single cases of the same groups
    (`single_ape_pct`), what falls away is the runs' own movement between processes. `sizes`
    names the fields that tell the configurations apart (batch sizes, or worker counts)."""
    groups = defaultdict(lambda: (defaultdict(list), {}, {}, []))
    for r in rows:
        if r.get("set") == "in_sample":
            continue
        key = (r["origin"], r["workload"], r[sizes[0]], r[sizes[1]])
        preds, measured, sources, rows_in = groups[key]
        preds[r["from"]].append(r["predicted_samples_per_s"])
        measured[r["to"]] = r["measured_samples_per_s"]
        sources[r["from"]] = r["source_samples_per_s"]
        rows_in.append(r)
    out = []
    for (origin, workload, s0, s1), (preds, measured, sources, rows_in) in groups.items():
        if len(preds) < 2 or len(measured) < 2:
            continue
        per_source = [statistics.mean(v) for v in preds.values()]
        predicted = statistics.median(per_source)
        target = statistics.median(measured.values())
        mean_pair = (statistics.mean(per_source), statistics.mean(measured.values()))
        regimes = {r.get("regime") for r in rows_in}
        out.append({
            "origin": origin, "workload": workload, sizes[0]: s0, sizes[1]: s1,
            "source_runs": len(preds), "target_runs": len(measured),
            "regime": regimes.pop() if len(regimes) == 1 else None,
            "predicted_samples_per_s": predicted, "measured_samples_per_s": target,
            "ape_pct": ape_pct(predicted, target),
            "naive_ape_pct": ape_pct(statistics.median(sources.values()), target),
            "mean_ape_pct": ape_pct(*mean_pair),
            "single_ape_pct": _mape(rows_in),
        })  # fmt: skip
    return out


def probe_rows(points: list[dict]) -> list[dict]:
    """Each run's warm-up probe of the host's issue time beside its measured step: where the
    GPU was not the bound (its kernels under 80% of the step), the probe should be the step
    less its bookkeeping. (The GPU step time of the steps series is no measure of that: it runs
    from one step's start on the GPU to the next, idle gaps included.)"""
    rows = []
    for p in points:
        if p["host_issue_s"] is None or p["gpus"] != 1:
            continue
        busy = p["kernel_s"] / p["step_s"] if p["kernel_s"] else None
        rows.append({
            "gpu": p["gpu"], "workload": p["key"][0], "batch": p["batch"], "run": p["run_id"],
            "kernel_share_of_step": busy, "step_s": p["step_s"], "compute_s": p["compute_s"],
            "host_issue_s": p["host_issue_s"], "issue_over_step": p["host_issue_s"] / p["step_s"],
        })  # fmt: skip
    return rows


def _kernel_share(point: dict) -> float | None:
    """The run's kernel time over its step (None unprofiled)."""
    return point["kernel_s"] / point["step_s"] if point["kernel_s"] else None


def _gpu_fill(point: dict) -> float | None:
    """The run's kernels and their queued gaps over its step (None unprofiled): at least the
    predictor's GPU_BOUND_FILL, the GPU set the pace."""
    if not point["kernel_s"]:
        return None
    return (point["kernel_s"] + point["gap_s"]) / point["step_s"]


def _min_fill(a: dict, b: dict) -> float | None:
    fills = (_gpu_fill(a), _gpu_fill(b))
    return None if None in fills else min(fills)


def _config(point: dict) -> tuple:
    """What makes two runs the same configuration (on one ladder)."""
    return (point["gpu"], *point["key"], point["batch"], point["gpus"], point["workers"])


def repeat_rows(points: list[dict]) -> list[dict]:
    """Runs of one configuration repeated on one machine (`REPEATS=2 predict_ladder.sh`), each
    taking the other's throughput as its prediction: the spread between processes, a floor
    under any prediction's error there."""
    groups = defaultdict(list)
    for p in points:
        groups[(*_config(p), p["origin"])].append(p)
    rows = []
    for (gpu, workload, *_), ps in groups.items():
        for a in ps:
            for b in ps:
                if a is not b:
                    rows.append({
                        "gpu": gpu, "workload": workload, "batch": a["batch"], "gpus": a["gpus"],
                        "from": a["run_id"], "to": b["run_id"],
                        "ape_pct": ape_pct(a["tput"], b["tput"]),
                        "kernel_share": _kernel_share(b),
                        # GPU-paced only where both runs were: a pair of a host-paced and a
                        # GPU-paced process of one configuration is the host's movement
                        "gpu_fill": _min_fill(a, b),
                    })  # fmt: skip
    return rows


def _round(point: dict) -> int | None:
    """The round of a ladder the run was in (its name ends in -rN), None where unnamed."""
    record = point.get("record")
    found = re.search(r"-r(\d+)$", (record.meta.get("name") or "") if record else "")
    return int(found.group(1)) if found else point.get("round")


def noise_floor(
    points: list[dict],
    runs_a_side: int = 3,
    min_runs: int = 3,
    draws: int = 200_000,
    seed: int = 0,
) -> dict | None:
    """What a perfect predictor would score against these runs, from their own movement
    between processes. A ladder runs every configuration once per round, so a run's log
    throughput is its configuration's level, plus its round's (the host's state then, shared
    by the round's runs), plus its own; both are estimated per ladder from the configurations
    run at least ``min_runs`` times (those the medians are scored on), the own part scaled up
    for the fitted levels' share of it. Drawn with replacement: a median of ``runs_a_side``
    runs in rounds 1..n against the target's median in the same rounds (``mape_pct``; the
    round's part cancels only partly), and single runs of any two rounds
    (``single_run_mape_pct``): the floor of a prediction that scales its source run's
    throughput (``predict --workers`` scales the measured loader's pace). One that does not
    carry its source run's movement meets only the target median's (``target_only_mape_pct``).
    None where no configuration ran ``min_runs`` times."""
    import numpy as np

    ladders: dict = defaultdict(lambda: defaultdict(dict))
    for p in points:
        runs = ladders[p["origin"]][_config(p)]
        runs[_round(p) or len(runs) + 1] = p["tput"]
    own, rounds = [], []
    for configs in ladders.values():
        kept = {c: r for c, r in configs.items() if len(r) >= max(min_runs, 2)}
        if not kept:
            continue
        names = sorted({r for rs in kept.values() for r in rs})
        y = np.full((len(kept), len(names)), np.nan)
        for a, rs in enumerate(kept.values()):
            for r, tput in rs.items():
                y[a, names.index(r)] = np.log(tput)
        level, shift = np.nanmean(y, axis=1), np.zeros(len(names))
        for _ in range(50):  # alternating means: exact for full rounds, close for a missing run
            shift = np.nan_to_num(np.nanmean(y - level[:, None], axis=0))
            shift -= shift.mean()
            level = np.nanmean(y - shift[None, :], axis=1)
        residual = (y - level[:, None] - shift[None, :])[~np.isnan(y)]
        n, fitted = residual.size, len(kept) + len(names) - 1
        if n > fitted:
            own.extend(residual * np.sqrt(n / (n - fitted)))
            rounds.extend(shift)
    if not own:
        return None
    rng = np.random.default_rng(seed)
    own_a, round_a = np.asarray(own), np.asarray(rounds)
    shared = rng.choice(round_a, (draws, runs_a_side))
    src = np.median(shared + rng.choice(own_a, (draws, runs_a_side)), axis=1)
    tgt = np.median(shared + rng.choice(own_a, (draws, runs_a_side)), axis=1)
    floor = float(np.mean(np.abs(np.exp(src - tgt) - 1)) * 100)
    # a prediction that does not carry its source run's movement (one from kernel times and
    # probes, not from the run's throughput) meets only the target's
    target_only = float(np.mean(np.abs(np.exp(-tgt) - 1)) * 100)
    one = rng.choice(round_a, draws) + rng.choice(own_a, draws)
    other = rng.choice(round_a, draws) + rng.choice(own_a, draws)
    single = float(np.mean(np.abs(np.exp(one - other) - 1)) * 100)
    return {
        "cases": len(own),  # runs that gave a deviation
        "mape_pct": floor,
        "naive_mape_pct": floor,
        "single_run_mape_pct": single,
        "target_only_mape_pct": target_only,
        "runs_a_side": runs_a_side,
        "own_sd_pct": float(np.std(own_a) * 100),
        "round_sd_pct": float(np.std(round_a) * 100),
    }


def gpus_cases(points: list[dict], count: int = 2) -> list[dict]:
    """Each 1-GPU run predicting the ``count``-GPU runs of its workload, batch and ladder."""
    rows = []
    for one in (p for p in points if p["gpus"] == 1):
        for two in points:
            same = (two["key"], two["batch"], two["origin"]) == (
                one["key"],
                one["batch"],
                one["origin"],
            )
            if two["gpus"] != count or not same or two["gpu"] != one["gpu"]:
                continue
            pred = predict_run(one["record"], Target(None, gpus=count))
            rows.append({
                "gpu": one["gpu"], "workload": one["key"][0], "batch_size": one["batch"],
                "origin": one["origin"], "to_gpus": count, "from": one["run_id"],
                "to": two["run_id"],
                "one_gpu_samples_per_s": one["tput"], "source_samples_per_s": one["tput"],
                "predicted_samples_per_s": pred.throughput_samples_per_s,
                "measured_samples_per_s": two["tput"],
                "ape_pct": ape_pct(pred.throughput_samples_per_s, two["tput"]),
                "naive_ape_pct": ape_pct(count * one["tput"], two["tput"]),
                "source_ci95_pct": one["ci95_pct"], "target_ci95_pct": two["ci95_pct"],
                # the host's pace plus DDP's host time bound the prediction, not the GPU
                "host_paced": "multi_gpu_host_paced" in pred.regimes,
                "notes": list(pred.notes),
            })  # fmt: skip
    return rows


def worker_record_cases(points: list[dict]) -> list[dict]:
    """Loader workers through the predictor: each run of a job with a loader predicting the
    job's runs at other worker counts on its machine (`benchmarks/workers_ladder.sh`) with
    `predict --workers`."""
    groups = defaultdict(list)
    for p in points:
        if p["gpus"] == 1 and p["workers"] > 0:
            groups[(p["gpu"], *p["key"], p["batch"], p["origin"])].append(p)
    rows = []
    for (gpu, workload, *_), ps in sorted(groups.items(), key=lambda kv: str(kv[0])):
        for src in ps:
            for tgt in ps:
                if tgt["workers"] == src["workers"]:
                    continue
                pred = predict_run(src["record"], Target(None, workers=tgt["workers"]))
                rows.append({
                    "gpu": gpu, "workload": workload, "origin": src["origin"],
                    "batch_size": src["batch"],
                    "from_workers": src["workers"], "to_workers": tgt["workers"],
                    "from": src["run_id"], "to": tgt["run_id"],
                    "predicted_samples_per_s": pred.throughput_samples_per_s,
                    "measured_samples_per_s": tgt["tput"],
                    "source_samples_per_s": src["tput"],
                    "ape_pct": ape_pct(pred.throughput_samples_per_s, tgt["tput"]),
                    "naive_ape_pct": ape_pct(src["tput"], tgt["tput"]),
                    "validated_error_pct": pred.validated_error_pct,
                    "source_ci95_pct": src["ci95_pct"], "target_ci95_pct": tgt["ci95_pct"],
                    "notes": list(pred.notes),
                })  # fmt: skip
    return rows


def workers_cases(allocate_json: Path) -> list[dict]:
    """Loader workers: each measured point of a job's curve (benchmarks/allocate_workers_gpu.py,
    every job loader-bound) predicting the others by the rule `predict --workers` applies to a
    loader-bound run: each worker keeps its measured pace (the GPU never bound these jobs)."""
    doc = json.loads(allocate_json.read_text())
    curves = defaultdict(dict)
    for r in doc["solo_curves"]:
        curves[r["job"]][r["workers"]] = (r["samples_per_s"], r["ci95_pct"])
    rows = []
    for job, pts in curves.items():
        for w0, (t0, ci0) in pts.items():
            for w1, (t1, ci1) in pts.items():
                if w0 != w1:
                    rows.append({
                        "workload": job, "from_workers": w0, "to_workers": w1,
                        "predicted_samples_per_s": t0 * w1 / w0, "measured_samples_per_s": t1,
                        "ape_pct": ape_pct(t0 * w1 / w0, t1), "naive_ape_pct": ape_pct(t0, t1),
                        "ci95_pct": max(ci0, ci1),
                    })  # fmt: skip
    return rows


# A run whose throughput's 95% interval over its steps is within this is steady enough to
# score a prediction on; beyond it, the run moved more than the figure it should check.
STEADY_CI_PCT = 5.0


def _figure(rows: list[dict]) -> dict:
    return {
        "cases": len(rows),
        "mape_pct": _mape(rows),
        "naive_mape_pct": _mape(rows, "naive_ape_pct"),
    }


def _averaged_figure(rows: list[dict]) -> dict:
    """A figure of `averaged_cases` rows, beside the mean error of their single cases."""
    return {**_figure(rows), "single_run_mape_pct": _mape(rows, "single_ape_pct")}


def _steady(row: dict) -> bool:
    cis = (row.get("source_ci95_pct"), row.get("target_ci95_pct"))
    return all(ci is not None and ci <= STEADY_CI_PCT for ci in cis)


def _mape(rows: list[dict], field: str = "ape_pct") -> float | None:
    return statistics.mean(r[field] for r in rows) if rows else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--workers-json",
        type=Path,
        help="an allocate_workers-*.json whose solo curves check the workers rule",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # an empty store: no 1-/2-GPU pair of the same workload calibrates the all-reduce
        os.environ["GPULENS_HOME"] = str(Path(tmp) / "home")
        points = [p for p in map(_point, load_records(args.runs, Path(tmp))) if p]
        for p in points:  # which of the given paths (one ladder: one machine) it came from
            p["origin"] = Path(p["record"].dir).resolve().relative_to(Path(tmp).resolve()).parts[0]
        batch = batch_cases(points)
        gpus = gpus_cases(points)
        counts = sorted({p["gpus"] for p in points if p["gpus"] > 2})
        gpus_more = [r for n in counts for r in gpus_cases(points, n)]  # beyond 2: apart
        worker_runs = worker_record_cases(points)
        probes = probe_rows(points)
        repeats = repeat_rows(points)
    print(f"{'gpu':<6} {'workload':<9} {'batch':>11} {'set':<9} {'pred':>8} {'meas':>8} "
          f"{'err%':>6} {'naive%':>7}")  # fmt: skip
    for r in batch:
        change = f"{r['from_batch']}->{r['to_batch']}"
        print(f"{r['gpu'][:6]:<6} {r['workload']:<9} {change:>11} {r['set']:<9} "
              f"{r['predicted_samples_per_s']:8.0f} {r['measured_samples_per_s']:8.0f} "
              f"{r['ape_pct']:+6.1f} {r['naive_ape_pct']:7.1f}")  # fmt: skip
    summary = {}
    for name in ("held_out", "in_sample", "other"):
        rs = [r for r in batch if r["set"] == name]
        if rs:
            summary[f"batch_{name}"] = _figure(rs)
    # up: the question "what would a larger batch give"; down: below a GPU-bound run's batch
    # the host's own pace (which a profiler window does not show) may bind instead
    for name, pick in (("up", lambda r: r["factor"] > 1), ("down", lambda r: r["factor"] < 1)):
        for subset in ("held_out", "out_of_sample", "all"):
            keep = {"held_out": ("held_out",), "out_of_sample": ("held_out", "other")}
            rs = [r for r in batch if pick(r) and r["set"] in keep.get(subset, (r["set"],))]
            if rs:
                summary[f"batch_{name}_{subset}"] = _figure(rs)
    # by the regime the predictor chose (what `predict` prints as its validated error)
    for regime in sorted({r["regime"] for r in batch if r["regime"]}):
        rs = [r for r in batch if r["regime"] == regime and r["set"] != "in_sample"]
        if rs:
            summary[f"regime_{regime}"] = _figure(rs)
    # the same, where both runs were steady (their own 95% intervals within STEADY_CI_PCT); a
    # run's interval over its steps does not show how far the host drifts between processes
    for regime in sorted({r["regime"] for r in batch if r["regime"]}):
        rs = [r for r in batch if r["regime"] == regime and r["set"] != "in_sample" and _steady(r)]
        if rs:
            summary[f"regime_{regime}_steady"] = _figure(rs)
    for lo, hi in ((1.9, 2.1), (3.9, 4.1), (7.9, 8.1)):
        rs = [r for r in batch if lo <= max(r["factor"], 1 / r["factor"]) <= hi]
        if rs:
            summary[f"batch_x{round(hi)}"] = _figure(rs)
    if gpus:
        print("\n1 GPU -> 2 GPUs (DDP, same host, all-reduce uncalibrated)")
        for r in gpus:
            one = r["one_gpu_samples_per_s"]
            print(f"  {r['workload']:<9} b{r['batch_size']:<4} 1 GPU {one:8.0f}"
                  f"  2 GPUs predicted {r['predicted_samples_per_s']:8.0f} measured "
                  f"{r['measured_samples_per_s']:8.0f}  err {r['ape_pct']:4.1f}%  "
                  f"(x2: {r['naive_ape_pct']:4.1f}%)")  # fmt: skip
        summary["gpus_1_to_2"] = _figure(gpus)
        for name, paced in (("host_paced", True), ("gpu_paced", False)):
            rs = [r for r in gpus if r["host_paced"] == paced]
            if rs:
                summary[f"gpus_1_to_2_{name}"] = _figure(rs)
        steady = [r for r in gpus if _steady(r)]
        if steady:
            summary["gpus_1_to_2_steady"] = _figure(steady)
        gpus_averaged = averaged_cases(gpus, ("batch_size", "to_gpus"))
        if gpus_averaged:
            summary["gpus_1_to_2_averaged"] = _averaged_figure(gpus_averaged)
    else:
        gpus_averaged = []
    for n in sorted({r["to_gpus"] for r in gpus_more}):
        rs = [r for r in gpus_more if r["to_gpus"] == n]
        print(f"\n1 GPU -> {n} GPUs (DDP, same host, all-reduce uncalibrated)")
        for r in rs:
            print(f"  {r['workload']:<9} b{r['batch_size']:<4} 1 GPU "
                  f"{r['one_gpu_samples_per_s']:8.0f}  {n} GPUs predicted "
                  f"{r['predicted_samples_per_s']:8.0f} measured {r['measured_samples_per_s']:8.0f}"
                  f"  err {r['ape_pct']:4.1f}%  (x{n}: {r['naive_ape_pct']:4.1f}%)")  # fmt: skip
        summary[f"gpus_1_to_{n}"] = _figure(rs)
        for name, paced in (("host_paced", True), ("gpu_paced", False)):
            if [r for r in rs if r["host_paced"] == paced]:
                summary[f"gpus_1_to_{n}_{name}"] = _figure(
                    [r for r in rs if r["host_paced"] == paced]
                )
    if worker_runs:
        print("\nloader workers (predict --workers, same GPU)")
        for r in worker_runs:
            print(f"  {r['workload']:<9} b{r['batch_size']:<4} w{r['from_workers']}->"
                  f"w{r['to_workers']:<3} predicted {r['predicted_samples_per_s']:8.0f} measured "
                  f"{r['measured_samples_per_s']:8.0f}  err {r['ape_pct']:5.1f}%")  # fmt: skip
        summary["workers_predicted"] = _figure(worker_runs)
        steady = [r for r in worker_runs if _steady(r)]
        if steady:
            summary["workers_predicted_steady"] = _figure(steady)
        workers_averaged = averaged_cases(worker_runs, ("from_workers", "to_workers"))
        if workers_averaged:
            summary["workers_predicted_averaged"] = _averaged_figure(workers_averaged)
    else:
        workers_averaged = []
    workers = workers_cases(args.workers_json) if args.workers_json else []
    if workers:
        steady = [r for r in workers if r["ci95_pct"] <= 10.0]
        for name, rs in (("workers", workers), ("workers_ci_le_10pct", steady)):
            summary[name] = _figure(rs)
    averaged = averaged_cases(batch)
    for regime in sorted({r["regime"] for r in averaged if r["regime"]}):
        rs = [r for r in averaged if r["regime"] == regime]
        summary[f"regime_{regime}_averaged"] = _averaged_figure(rs)
    if repeats:  # the same configuration twice: the floor under every figure above
        figure = _mape(repeats)  # a repeat's "naive" prediction is itself
        summary["repeats"] = {"cases": len(repeats), "mape_pct": figure, "naive_mape_pct": figure}
        # the floor under the median-of-runs figures: a perfect predictor scored against
        # medians of 3 runs a side, for the loader-fed runs, the runs whose host set the pace
        # (kernels and their gaps under GPU_BOUND_FILL of the step) and all
        host_paced_pairs = {(r["origin"], r["workload"], r["batch_size"]) for r in gpus
                            if r["host_paced"]}  # fmt: skip
        floors = {
            "noise_floor_loader_fed": [p for p in points if p["workers"] > 0 and not p["key"][2]],
            "noise_floor_host_bound": [
                p for p in points if (_gpu_fill(p) or GPU_BOUND_FILL) < GPU_BOUND_FILL
            ],
            "noise_floor_host_bound_one_gpu": [  # what the batch changes are scored against
                p
                for p in points
                if p["gpus"] == 1 and (_gpu_fill(p) or GPU_BOUND_FILL) < GPU_BOUND_FILL
            ],
            # the 1- and 2-GPU runs of the pairs whose host paced the prediction (medians of
            # 3 a side here; e893365's pairs have 5)
            "noise_floor_host_paced_gpus": [
                p for p in points if (p["origin"], p["key"][0], p["batch"]) in host_paced_pairs
            ],
            "noise_floor_all": points,
        }
        for name, ps in floors.items():
            floor = noise_floor(ps)
            if floor:
                summary[name] = floor
    # by what set the measured run's pace: the GPU (kernels and their gaps >= GPU_BOUND_FILL
    # of the step) or the host
    bound = {
        "gpu_bound": lambda fill: fill is not None and fill >= GPU_BOUND_FILL,
        "host_bound": lambda fill: fill is not None and fill < GPU_BOUND_FILL,
    }
    for name, pick in bound.items():
        rs = [r for r in repeats if pick(r["gpu_fill"])]
        if rs:
            figure = _mape(rs)
            summary[f"repeats_{name}"] = {"cases": len(rs), "mape_pct": figure,
                                          "naive_mape_pct": figure}  # fmt: skip
        for direction, sign in (("up", 1), ("down", -1)):
            rs = [r for r in batch if pick(r["target_gpu_fill"]) and r["set"] != "in_sample"
                  and (r["factor"] - 1) * sign > 0]  # fmt: skip
            if rs:
                summary[f"batch_{direction}_{name}"] = _figure(rs)
    if probes:
        print("\nhost issue probe (idle GPU) against the measured step")
        for r in probes:
            share = r["kernel_share_of_step"]
            busy = f"{share:.0%}" if share is not None else "n/a"
            print(f"  {r['workload']:<9} b{r['batch']:<4} kernels {busy:>4} of the step  step "
                  f"{r['step_s'] * 1e3:7.2f} ms  probe {r['host_issue_s'] * 1e3:7.2f} ms  "
                  f"probe/step {r['issue_over_step']:.2f}")  # fmt: skip
    # smaller batches (out of sample) by whether the source run probed its host (since 1177ff4)
    for name, probed in (("batch_down_probed", True), ("batch_down_unprobed", False)):
        rs = [
            r
            for r in batch
            if r["factor"] < 1
            and r["set"] != "in_sample"
            and (r["source_host_issue_s"] is not None) == probed
        ]
        if rs:
            summary[name] = _figure(rs)
    print("\nMAPE (throughput; naive: unchanged samples/s, or doubled for 2 GPUs)")
    for name, t in summary.items():
        print(f"  {name:<18} {t['cases']:3d} cases  MAPE {t['mape_pct']:5.1f}%  "
              f"naive {t['naive_mape_pct']:5.1f}%")  # fmt: skip
    if args.out:
        doc = {
            "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "summary": summary,
            "batch_cases": batch,
            "gpus_cases": gpus,
            "gpus_more_cases": gpus_more,
            "worker_run_cases": worker_runs,
            "workers_cases": workers,
            "host_issue_probes": probes,
            "repeat_cases": repeats,
            "averaged_cases": averaged,
            "averaged_worker_cases": workers_averaged,
            "averaged_gpus_cases": gpus_averaged,
        }
        args.out.write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
