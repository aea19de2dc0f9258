"""Collocation on one GPU (issue 4), in one call of under ~8 minutes on an H100.

(1) two and four copies of resnet18 at batch 64, and resnet50 + resnet18, under time-slicing,
    streams and MPS at several thread percentages (and MIG where instances exist): aggregate
    throughput, slowdowns, fairness, energy per sample;
(2) an inference job's p50/p99 latency next to a training job under each mechanism, with and
    without stream priority / an MPS thread limit for the trainer;
(3) the planner's choice against exhaustive search over what (1) and (2) measured.

Every experiment is stored as a gpulens run (kind ``colocate``) and the whole suite is written to
``--out`` after each experiment, so a suite stopped half-way still leaves its data. A mechanism
or an experiment that fails is recorded with its error; the suite goes on.

    python benchmarks/colocate_suite.py --out $OUT/colocate.json [--duration 10] [--warmup 2]
        [--pcts 25,50,100] [--precision fp32] [--infer infer:resnet50:batch=1,rate=100]
        [--parts 1,2,3] [--budget-s 450] [--device cuda:0]

A CPU smoke test (streams, MPS and MIG report themselves unavailable there):

    python benchmarks/colocate_suite.py --device cpu --models tiny_cnn,tiny_cnn --batch 8 \
        --infer infer:tiny_cnn:batch=1,rate=20 --duration 1 --warmup 0.3 --out /tmp/c.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from datetime import date
from pathlib import Path
from typing import Any

from gpulens.colocate import ColocateConfig, probe_device, run_colocate
from gpulens.colocate.plan import plan
from gpulens.paths import runs_dir
from gpulens.workloads.jobspec import parse_job, unique_names

PER_RUN_OVERHEAD_S = 7.0  # process start, torch import, CUDA context, model build


def _train_jobs(args) -> tuple[str, str]:
    small, big = args.models.split(",")
    opts = f"batch={args.batch},precision={args.precision}"
    return f"{small}:{opts}", f"{big}:{opts}"


def _experiments(args) -> list[dict[str, Any]]:
    r18, r50 = _train_jobs(args)
    train_mechs = ["time-slice", "streams", "mps", "mig"]
    exps = []
    if "1" in args.parts:
        exps += [
            {"id": "2x_resnet18", "part": 1, "jobs": [r18, r18], "mechanisms": train_mechs},
            {"id": "4x_resnet18", "part": 1, "jobs": [r18] * 4, "mechanisms": train_mechs},
            {"id": "resnet50+resnet18", "part": 1, "jobs": [r50, r18], "mechanisms": train_mechs},
        ]
    if "2" in args.parts:
        exps.append({"id": "train+infer", "part": 2, "jobs": [r18, args.infer],
                     "mechanisms": train_mechs})  # fmt: skip
    return exps


def _runs_in(exp: dict[str, Any], n_pcts: int) -> int:
    n = 0
    for m in exp["mechanisms"]:
        n += {"time-slice": 1, "streams": 2 if "infer" in " ".join(exp["jobs"]) else 1,
              "mps": n_pcts, "mig": 0}[m]  # fmt: skip
    return n


def _plans(docs: list[dict[str, Any]], args) -> list[dict[str, Any]]:
    r18, r50 = _train_jobs(args)
    sets = {
        "4x_resnet18+resnet50": [r18] * 4 + [r50],
        "2x_resnet18+resnet50": [r18, r18, r50],
        "2x_resnet18+resnet50+infer": [r18, r18, r50, args.infer],
    }
    out = []
    for set_id, jobs in sets.items():
        specs = unique_names([parse_job(j) for j in jobs])
        for cap in (None, 1.5, 2.0):
            try:
                p = plan(specs, docs, cap)
                out.append({"id": set_id, "max_slowdown": cap, "plan": p})
            except Exception as exc:
                out.append({"id": set_id, "max_slowdown": cap, "error": f"{exc}"})
    return out


def _ms(value_s: float | None) -> str:
    return "n/a" if value_s is None else f"{1000 * value_s:.1f}"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _row(exp_id: str, r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        why = r["error"] if str(r["error"]).startswith(("unavailable", "does not fit")) else \
            f"{r['status']}: {r['error']}"  # fmt: skip
        return f"{exp_id:<20} {r['mechanism']:<11} {r['setting']:<28} {why}"
    slow = " ".join(f"{j['slowdown']:.2f}" for j in r["jobs"] if j["slowdown"] is not None)
    infer = [j for j in r["jobs"] if j["kind"] == "infer"]
    lat = ""
    if infer and infer[0].get("step_time_p99_s") is not None:
        j = infer[0]
        lat = (
            f" infer p50/p99 {_ms(j['step_time_p50_s'])}/{_ms(j['step_time_p99_s'])} ms "
            f"(alone {_ms(j['step_time_p50_alone_s'])}/{_ms(j['step_time_p99_alone_s'])})"
        )
    eps = r.get("energy_per_sample_j")
    return (
        f"{exp_id:<20} {r['mechanism']:<11} {r['setting']:<28} "
        f"agg {_x(r['normalized_aggregate_throughput'])}x  jain {_x(r['jain_fairness'])}  "
        f"slowdown {slow}  J/sample {eps if eps is None else round(eps, 3)}  "
        f"energy vs alone {_x(r.get('energy_vs_alone_ratio'))}{lat}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    ap.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per run")
    ap.add_argument("--pcts", default="25,50,100", help="MPS active-thread percentages")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--models", default="resnet18,resnet50", help="the small and the big model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--infer", default="infer:resnet50:batch=1,rate=100",
                    help="the inference job of part 2")  # fmt: skip
    ap.add_argument("--parts", default="1,2,3")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=450.0,
        help="skip experiments that would not finish within this many seconds",
    )
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    args.parts = set(args.parts.split(","))
    pcts = tuple(float(x) for x in args.pcts.split(","))
    out = args.out or Path(os.environ.get("OUT", "benchmarks/results"), "colocate.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    doc: dict[str, Any] = {
        "benchmark": "colocate_suite",
        "date": date.today().isoformat(),
        "command": " ".join(["python", *sys.argv]),
        "settings": {
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "mps_thread_pcts": list(pcts),
            "precision": args.precision,
            "infer": args.infer,
        },  # fmt: skip
        "experiments": [],
        "plans": [],
    }

    def save() -> None:
        doc["elapsed_s"] = round(time.monotonic() - t0, 1)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        tmp.replace(out)

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)

    try:
        info = probe_device(args.device)
    except Exception as exc:
        doc["error"] = f"device probe failed: {exc}"
        save()
        print(doc["error"])
        return 1
    doc["gpu"] = info.as_dict()
    say(f"device: {info.name or info.device}")
    alone: dict[str, dict[str, Any]] = {}
    per_run_s = args.duration + args.warmup + PER_RUN_OVERHEAD_S
    for exp in _experiments(args):
        new_alone = len({parse_job(j).key for j in exp["jobs"]} - set(alone))
        estimate = per_run_s * (_runs_in(exp, len(pcts)) + new_alone)
        entry: dict[str, Any] = {"id": exp["id"], "part": exp["part"], "jobs": exp["jobs"]}
        if time.monotonic() - t0 + estimate > args.budget_s:
            entry["skipped"] = (
                f"would exceed --budget-s {args.budget_s:g} (estimate {estimate:.0f} s)"
            )
            doc["experiments"].append(entry)
            say(f"{exp['id']}: skipped ({entry['skipped']})")
            save()
            continue
        say(f"{exp['id']}: start (estimate {estimate:.0f} s)")
        t_exp = time.monotonic()
        try:
            config = ColocateConfig(
                jobs=[parse_job(j) for j in exp["jobs"]], mechanisms=tuple(exp["mechanisms"]),
                mps_thread_pcts=pcts, duration_s=args.duration, warmup_s=args.warmup,
                name=f"suite-{exp['id']}",
            )  # fmt: skip
            result = run_colocate(config, runs_dir(), progress=lambda m, e=exp: say(
                f"{e['id']}: {m}"), alone_cache=alone, device_info=info)  # fmt: skip
            entry["colocate"] = result
        except BaseException as exc:  # one experiment must not end the suite (Ctrl-C does)
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()[-2000:]
            if isinstance(exc, KeyboardInterrupt):
                doc["experiments"].append(entry)
                save()
                raise
        entry["elapsed_s"] = round(time.monotonic() - t_exp, 1)
        doc["experiments"].append(entry)
        save()
        say(f"{exp['id']}: done in {entry['elapsed_s']} s")
    if "3" in args.parts:
        docs = [e["colocate"] for e in doc["experiments"] if e.get("colocate")]
        doc["plans"] = _plans(docs, args)
        save()

    print("\n=== collocation (agg = normalized aggregate throughput; slowdown = alone/together)")
    for e in doc["experiments"]:
        if "colocate" not in e:
            print(f"{e['id']:<20} {e.get('skipped') or e.get('error')}")
            continue
        for j in e["colocate"]["jobs"]:
            tput = j["throughput_alone"]
            print(f"{e['id']:<20} alone {j['name']:<24} "
                  f"{'n/a' if tput is None else f'{tput:,.1f}'} samples/s")  # fmt: skip
        for r in e["colocate"]["results"]:
            print(_row(e["id"], r))
        print(f"{e['id']:<20} -> {e['colocate']['recommendation']}")
    if doc["plans"]:
        print("\n=== plan vs exhaustive search over what was measured")
        for p in doc["plans"]:
            cap = "none" if p["max_slowdown"] is None else f"{p['max_slowdown']:g}x"
            if "error" in p:
                print(f"{p['id']:<28} cap {cap:<5} error: {p['error']}")
                continue
            mine, best = p["plan"]["plan"], p["plan"]["exhaustive"]
            print(
                f"{p['id']:<28} cap {cap:<5} plan {_x(mine['normalized_throughput_per_gpu'])}x/GPU"
                f" on {mine['gpus']} GPU(s), exhaustive "
                f"{_x(best['normalized_throughput_per_gpu'])}x/GPU on {best['gpus']}: "
                f"quality {_x(p['plan']['quality'])}  | {p['plan']['recommendation']}"
            )
    print(f"\nwrote {out} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
