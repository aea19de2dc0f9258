"""Interconnect scaling ladder (issue 5): 1, 2, 4, 8 GPUs of one host, NVLink/P2P and sockets.

For each workload and each GPU count N the machine has (others are skipped and listed):
- weak scaling: DDP with the same per-GPU batch, NCCL's default transport (P2P/NVLink) and
  NCCL forced onto sockets; the compute / interconnect / network breakdown per GPU;
- strong scaling: the same global batch split over N GPUs (default transport);
- an all-reduce microbenchmark (message sizes 8 KiB .. 256 MiB) for each transport.
A ring all-reduce model (latency and bandwidth terms) is fitted on the 2-GPU microbenchmark and,
with the exposed share of communication calibrated on the 1- and 2-GPU training runs, predicts
the step time at every N; its error is reported wherever N was measured.

    python benchmarks/scaling_ladder.py --gpus 1,2,4,8 --out results.json
    python benchmarks/scaling_ladder.py --gpus 1,2 --duration 8      # dry run on 2 GPUs

Run it with NCCL_NVLS_ENABLE=0 where the machine asks for NVLink multicast to stay off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

from gpulens.predict.allreduce import calibrate_scaling, fit_ring_model
from gpulens.stalls import breakdown, measure_run
from gpulens.workloads.config import TrainConfig
from gpulens.workloads.distributed import free_port, transport_env
from gpulens.workloads.models import get_workload
from gpulens.workloads.train import run_training

SIZES_BYTES = [2**k for k in range(13, 29, 2)]  # 8 KiB .. 128 MiB, every factor of 4


def _allreduce_rank(rank: int, world: int, port: int, env: dict, sizes, iters: int, out):
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dev = torch.device(f"cuda:{rank}")
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    times = []
    for size in sizes:
        buf = torch.ones(size // 4, dtype=torch.float32, device=dev)
        for _ in range(3):
            dist.all_reduce(buf)
        torch.cuda.synchronize()
        samples = []
        for _ in range(iters):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
        samples.sort()
        times.append(samples[len(samples) // 2])
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def allreduce_times(world: int, transport: str, iters: int = 10) -> list[float]:
    """Median seconds per all-reduce of each size in SIZES_BYTES over ``world`` GPUs."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(
        _allreduce_rank,
        args=(world, port, transport_env(transport), SIZES_BYTES, iters, out),
        nprocs=world,
        start_method="spawn",
    )
    return out.get(timeout=60)


def _run(runs: Path, workload: str, precision: str, batch: int, gpus: int, transport: str,
         duration_s: float) -> dict[str, Any]:  # fmt: skip
    t0 = time.time()
    r = run_training(
        TrainConfig(
            workload=workload, precision=precision, batch_size=batch, gpus=gpus,
            nccl_transport=transport, duration_s=duration_s, count_flops=False,
            name=f"ladder-{workload}-{gpus}-{transport}-b{batch}",
        ),
        runs,
    )  # fmt: skip
    s = r.summary
    run_json = json.loads((r.record_dir / "run.json").read_text())
    return {
        "gpus": gpus,
        "transport": transport,
        "per_gpu_batch": batch,
        "throughput_samples_per_s": s["throughput_samples_per_s"],
        "throughput_ci95_pct": s["throughput_ci95_pct"],
        "step_time_s": s["phases_s"]["step"],
        "transport_effective": run_json["effective_config"].get("transport_effective"),
        "run_id": r.run_id,
        "wall_s": time.time() - t0,
        "_result": r,
    }


def ladder(workload: str, precision: str, batch: int, counts: list[int], duration_s: float,
           runs: Path, micro: dict) -> dict[str, Any]:  # fmt: skip
    spec = get_workload(workload)
    grad_bytes = 4.0 * sum(p.numel() for p in spec.build().parameters())
    rows = []
    by_key = {}
    for n in counts:
        transports = ["default"] if n == 1 else ["default", "socket"]
        for transport in transports:
            row = _run(runs, workload, precision, batch, n, transport, duration_s)
            by_key[(n, transport, "weak")] = row
            rows.append({"scaling": "weak", **row})
            print(f"  {workload} N={n} {transport}: {row['throughput_samples_per_s']:.0f}/s",
                  flush=True)  # fmt: skip
        if n > 1 and batch % n == 0:
            row = _run(runs, workload, precision, batch // n, n, "default", duration_s)
            by_key[(n, "default", "strong")] = row
            rows.append({"scaling": "strong", **row})
    one = by_key[(1, "default", "weak")]
    tput_1 = one["throughput_samples_per_s"]
    for row in rows:
        n = row["gpus"]
        row["efficiency"] = row["throughput_samples_per_s"] / (n * tput_1)
        if row["scaling"] == "weak" and n > 1 and row["transport"] == "default":
            socket_row = by_key.get((n, "socket", "weak"))
            shares, cis = breakdown(
                measure_run(one["_result"]), measure_run(one["_result"]), None,
                measure_run(row["_result"]),
                measure_run(socket_row["_result"]) if socket_row else None,
            )  # fmt: skip
            row["breakdown_pct"] = {
                k: shares[k] for k in ("compute", "interconnect_stall", "network_stall")
            }
            row["breakdown_ci95_pp"] = {
                k: cis[k] for k in ("compute", "interconnect_stall", "network_stall")
            }
    predictions = {}
    for transport, fit in micro.get("fits", {}).items():
        two = by_key.get((2, transport, "weak"))
        if two is None or fit is None:
            continue
        from gpulens.predict.allreduce import RingModel

        model = RingModel(**fit)
        pred = calibrate_scaling(one["step_time_s"], two["step_time_s"], grad_bytes, model)
        per_n = {}
        for n in (1, 2, 4, 8):
            predicted = pred.step_time_s(n)
            measured = by_key.get((n, transport if n > 1 else "default", "weak"))
            per_n[str(n)] = {
                "predicted_step_time_s": predicted,
                "predicted_throughput_samples_per_s": n * batch / predicted,
                "measured_step_time_s": measured["step_time_s"] if measured else None,
                "error_pct": 100.0 * (predicted / measured["step_time_s"] - 1.0)
                if measured
                else None,
            }
        predictions[transport] = {
            "exposed_fraction": pred.exposed_fraction,
            "buckets": pred.buckets,
            "per_gpus": per_n,
        }
    for row in rows:
        row.pop("_result")
    return {
        "workload": workload,
        "precision": precision,
        "per_gpu_batch": batch,
        "gradient_bytes": grad_bytes,
        "runs": rows,
        "predictions": predictions,
    }


def microbench(counts: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"sizes_bytes": SIZES_BYTES, "times_s": {}, "fits": {}, "checks": {}}
    for transport in ("default", "socket"):
        for n in counts:
            if n < 2:
                continue
            out["times_s"][f"{n}-{transport}"] = allreduce_times(n, transport)
        times_2 = out["times_s"].get(f"2-{transport}")
        if not times_2:
            out["fits"][transport] = None
            continue
        model = fit_ring_model(SIZES_BYTES, times_2, 2)
        out["fits"][transport] = model.as_dict()
        for n in counts:
            measured = out["times_s"].get(f"{n}-{transport}")
            if measured and n != 2:
                errs = [
                    100.0 * (model.allreduce_s(s, n) / t - 1.0)
                    for s, t in zip(SIZES_BYTES, measured, strict=True)
                ]
                out["checks"][f"{n}-{transport}"] = {"error_pct_by_size": errs}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="1,2,4,8", help="GPU counts to try (those present run).")
    ap.add_argument("--workloads", default="resnet50:bf16:128,gpt2:bf16:16",
                    help="workload:precision:per-GPU batch, comma-separated")  # fmt: skip
    ap.add_argument("--duration", type=float, default=15.0, help="Measured seconds per run.")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    have = torch.cuda.device_count()
    wanted = [int(x) for x in args.gpus.split(",")]
    counts = [n for n in wanted if n <= have]
    skipped = [n for n in wanted if n > have]
    if not counts or 1 not in counts or 2 not in counts:
        print(f"error: needs at least 2 GPUs (this machine has {have})", file=sys.stderr)
        return 2
    doc: dict[str, Any] = {
        "benchmark": "scaling_ladder",
        "date": date.today().isoformat(),
        "command": " ".join(["python", *sys.argv]),
        "gpu": torch.cuda.get_device_name(0),
        "gpus_present": have,
        "gpus_measured": counts,
        "gpus_not_measured": skipped,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL"))},
    }
    print("all-reduce microbenchmark", flush=True)
    doc["allreduce"] = microbench(counts)
    doc["workloads"] = []
    with tempfile.TemporaryDirectory() as tmp:
        for item in args.workloads.split(","):
            workload, precision, batch = item.split(":")
            print(f"ladder {workload}", flush=True)
            doc["workloads"].append(
                ladder(
                    workload,
                    precision,
                    int(batch),
                    counts,
                    args.duration,
                    Path(tmp),
                    doc["allreduce"],
                )  # fmt: skip
            )
    gpu = doc["gpu"].replace(" ", "_")
    out = args.out or Path(
        os.environ.get("OUT", "benchmarks/results"),
        f"scaling_ladder-{gpu}x{max(counts)}-{doc['date']}.json",
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"\nfits: {doc['allreduce']['fits']}")
    print(f"{'workload':10} {'N':>2} {'transport':9} {'scaling':7} {'samples/s':>10} "
          f"{'eff':>5} {'interconn%':>10} {'network%':>8}")  # fmt: skip
    for w in doc["workloads"]:
        for r in w["runs"]:
            b = r.get("breakdown_pct") or {}
            inter, net = b.get("interconnect_stall"), b.get("network_stall")
            print(
                f"{w['workload']:10} {r['gpus']:>2} {r['transport']:9} {r['scaling']:7} "
                f"{r['throughput_samples_per_s']:>10.0f} {r['efficiency']:>5.2f} "
                f"{'' if inter is None else f'{inter:.1f}':>10} "
                f"{'' if net is None else f'{net:.1f}':>8}"
            )
        for transport, p in w["predictions"].items():
            preds = ", ".join(
                f"N={n}: {v['predicted_throughput_samples_per_s']:.0f}/s"
                + (f" (err {v['error_pct']:+.1f}%)" if v["error_pct"] is not None else "")
                for n, v in p["per_gpus"].items()
            )
            print(f"  model {transport}: exposed {p['exposed_fraction']:.2f}; {preds}")
    if skipped:
        print(f"not measured (machine has {have} GPUs): N = {skipped}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
