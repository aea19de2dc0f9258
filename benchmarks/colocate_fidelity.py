"""Issue 15, colocation fidelity: `gpulens colocate` against plain training processes on one GPU.

Each round (arms rotated from round to round, all in one call) runs:
  plain_alone     one plain PyTorch training process (the model, batch and precision of the jobs)
  plain_ts        two plain processes at once, no MPS (time-slicing)
  plain_mps       two plain processes under a private MPS daemon (no thread limit set)
  plain_mps_100   the same with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 (what colocate sets)
  plain_mps_sync  two plain processes under MPS that wait for every step (torch.cuda.synchronize
                  after each step: what the colocate jobs did before they queued their steps)
  plain_alone_stream  one plain process whose loop runs on a side CUDA stream (as a job's does)
  plain_alone_mimic   one plain process shaped like a colocate job: its loop in a second thread,
                  on a side stream, a CUDA event recorded per step and waited for two steps later
  gpulens         `gpulens colocate JOB JOB --mechanisms time-slice,mps --mps-thread-pct 100`:
                  its alone figure, time-slice and MPS together

A plain process: model.to(channels_last), bf16 autocast, SGD(momentum 0.9), zero_grad(set_to_none),
one batch on the device, the default stream, no synchronize in the loop; all processes of an arm
build and warm up, then start on one go time and measure for the same seconds; throughput =
steps x batch / (time until the GPU finished them). The ratio per round is gpulens / plain (sum
over the two processes together; the alone figure against plain_alone).

    PYTHONPATH=src python benchmarks/colocate_fidelity.py --rounds 3 --out $OUT/fidelity.json
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GO_DELAY_S = 1.0


# ------------------------------------------------------------------------- the plain process
def plain_worker(spec: dict) -> None:
    import torch

    from gpulens.workloads.models import get_workload

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    wl = get_workload(spec["model"])
    torch.manual_seed(0)
    model = wl.build().to(device).to(memory_format=torch.channels_last)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn((spec["batch"], *wl.input_shape), device=device)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, wl.num_classes, (spec["batch"],), device=device)
    sync_each = spec["sync_each_step"]
    shape = spec.get("shape", "plain")  # plain, stream (side stream) or mimic (a job's shape)
    stream = torch.cuda.Stream() if shape in ("stream", "mimic") else None
    if stream is not None:
        torch.cuda.current_stream().synchronize()

    def step() -> None:
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sync_each:
            torch.cuda.synchronize()

    def loop(doc: dict) -> None:
        import contextlib

        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < spec["warmup_s"]:
                step()
            torch.cuda.synchronize()
            Path(spec["ready_file"]).write_text("ready")
            while not Path(spec["go_file"]).exists():
                time.sleep(0.002)
            go = float(Path(spec["go_file"]).read_text())
            while time.time() < go:
                time.sleep(0.0005)
            start = time.perf_counter()
            end_unix = go + spec["duration_s"]
            steps, events = 0, []
            while time.time() < end_unix:
                step()
                steps += 1
                if shape == "mimic":
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record(stream)
                    events.append(ev)
                    if len(events) > 2:
                        events[-3].synchronize()
            torch.cuda.synchronize()
            window_s = time.perf_counter() - start
        doc.update(steps=steps, window_s=window_s, samples_per_s=steps * spec["batch"] / window_s)

    doc: dict = {}
    if shape == "mimic":
        import threading

        t = threading.Thread(target=loop, args=(doc,))
        t.start()
        t.join()
    else:
        loop(doc)
    Path(spec["result_file"]).write_text(json.dumps(doc))


def run_plain(
    n: int, args, env: dict[str, str], sync_each: bool, shape: str = "plain"
) -> list[float]:
    """``n`` plain processes started together; samples/s of each."""
    d = Path(tempfile.mkdtemp(prefix="fidelity-"))
    go = d / "go"
    procs, results = [], []
    for i in range(n):
        spec = {"model": args.model, "batch": args.batch, "warmup_s": args.warmup_s,
                "duration_s": args.duration_s, "sync_each_step": sync_each, "shape": shape,
                "ready_file": str(d / f"ready{i}"), "go_file": str(go),
                "result_file": str(d / f"result{i}.json")}  # fmt: skip
        results.append(Path(spec["result_file"]))
        procs.append(
            subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], env=env)
        )
    deadline = time.monotonic() + 300
    while not all((d / f"ready{i}").exists() for i in range(n)):
        if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise RuntimeError("a plain process failed before it was ready")
        time.sleep(0.01)
    tmp = d / "go.tmp"
    tmp.write_text(repr(time.time() + GO_DELAY_S))
    os.replace(tmp, go)
    for p in procs:
        p.wait(timeout=args.duration_s + 120)
    return [json.loads(r.read_text())["samples_per_s"] for r in results]


# ------------------------------------------------------------------------------- the arms
def arm_plain(name: str, args, gpu_uuid: str | None) -> dict:
    from gpulens.launch.mps import PrivateMps

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    if name == "plain_alone":
        return {"per_process": run_plain(1, args, env, False)}
    if name in ("plain_alone_stream", "plain_alone_mimic"):
        return {"per_process": run_plain(1, args, env, False, name.rsplit("_", 1)[1])}
    if name == "plain_ts":
        return {"per_process": run_plain(2, args, env, False)}
    sync_each = name == "plain_mps_sync"
    pct = 100.0 if name == "plain_mps_100" else None
    with PrivateMps(gpu_uuid=gpu_uuid) as daemon:
        client = {**daemon.client_env(pct), "PYTHONPATH": str(ROOT / "src")}
        return {"per_process": run_plain(2, args, client, sync_each)}


def arm_gpulens(args) -> dict:
    job = f"{args.model}:batch={args.batch},precision=bf16"
    cmd = [sys.executable, "-m", "gpulens.cli", "colocate", job, job,
           "--mechanisms", "time-slice,mps", "--mps-thread-pct", "100",
           "--duration", str(args.duration_s), "--warmup-s", str(args.warmup_s),
           "--no-store", "--json"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    if proc.returncode != 0:
        raise RuntimeError(f"gpulens colocate exited {proc.returncode}: {proc.stderr[-2000:]}")
    doc = json.loads(proc.stdout)
    out: dict = {"command": " ".join(cmd[2:])}
    for res in doc["results"]:
        jobs = res["jobs"]
        out[res["mechanism"]] = [j["throughput_together"] for j in jobs]
        out["alone"] = [j["throughput_alone"] for j in jobs]
    return out


def interval95(xs: list[float]) -> list[float] | None:
    from gpulens.stats import t95

    if len(xs) < 2:
        return None
    m, sd = statistics.fmean(xs), statistics.stdev(xs)
    h = t95(len(xs) - 1) * sd / len(xs) ** 0.5
    return [round(m - h, 4), round(m + h, 4)]


def summarize(rounds: list[dict]) -> dict:
    """Per round: gpulens / plain for alone, time-slice and MPS (sums of the two processes)."""
    pairs = {
        "alone": ("alone", "plain_alone", 1),
        "time_slice": ("time-slice", "plain_ts", 2),
        "mps": ("mps", "plain_mps", 2),
        "mps_vs_plain_100": ("mps", "plain_mps_100", 2),
        "alone_vs_plain_stream": ("alone", "plain_alone_stream", 1),
        "alone_vs_plain_mimic": ("alone", "plain_alone_mimic", 1),
    }
    out = {}
    for key, (g, p, n) in pairs.items():
        ratios = []
        for r in rounds:
            gl, pl = r.get("gpulens", {}).get(g), r.get(p, {}).get("per_process")
            if gl and pl and all(gl) and all(pl):
                ratios.append(sum(gl[:n]) / n / (sum(pl) / len(pl)))
        if ratios:
            out[key] = {"ratios": [round(x, 4) for x in ratios],
                        "median": round(statistics.median(ratios), 4),
                        "ci95": interval95(ratios)}  # fmt: skip
    both = [
        (r["plain_mps_sync"]["per_process"], r["plain_mps"]["per_process"])
        for r in rounds
        if "per_process" in r.get("plain_mps_sync", {}) and "per_process" in r.get("plain_mps", {})
    ]
    if both:
        ratios = [sum(s) / sum(p) for s, p in both]
        out["plain_sync_each_step_vs_plain_mps"] = {
            "ratios": [round(x, 4) for x in ratios], "median": round(statistics.median(ratios), 4),
            "ci95": interval95(ratios)}  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--duration-s", type=float, default=8.0)
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=480.0, help="start no round after this")
    ap.add_argument("--arms", default="gpulens,plain_alone,plain_ts,plain_mps,plain_mps_100,"
                    "plain_mps_sync")  # fmt: skip
    ap.add_argument("--out", type=Path, help="where the JSON goes (required)")
    args = ap.parse_args()
    if args.worker:
        plain_worker(json.loads(args.worker))
        return 0
    if args.out is None:
        ap.error("--out FILE is required")
    from gpulens.colocate import probe_device

    info = probe_device(None)
    arms = args.arms.split(",")
    doc = {"gpu": info.name, "model": args.model, "batch": args.batch, "precision": "bf16",
           "duration_s": args.duration_s, "warmup_s": args.warmup_s,
           "command": " ".join(sys.argv), "rounds": []}  # fmt: skip
    t0 = time.monotonic()
    per_round_s = 0.0
    for k in range(args.rounds):
        if k and time.monotonic() - t0 + per_round_s > args.budget_s:
            doc["stopped"] = f"budget: {k} rounds"
            break
        t_round = time.monotonic()
        order = arms[k % len(arms) :] + arms[: k % len(arms)]
        row: dict = {"order": order}
        for arm in order:
            t_arm = time.monotonic()
            try:
                if arm == "gpulens":
                    row[arm] = arm_gpulens(args)
                else:
                    row[arm] = arm_plain(arm, args, info.uuid)
            except Exception as exc:  # one failed arm is recorded; the others go on
                row[arm] = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
            row[arm]["wall_s"] = round(time.monotonic() - t_arm, 1)
            print(f"round {k} {arm}: {json.dumps(row[arm])[:1500]}", file=sys.stderr, flush=True)
        doc["rounds"].append(row)
        doc["summary"] = summarize(doc["rounds"])
        args.out.write_text(json.dumps(doc, indent=1))
        per_round_s = max(per_round_s, time.monotonic() - t_round)
    print(f"{'gpulens / plain':<36} {'median':>8}  95% interval   per round")
    for key, s in doc.get("summary", {}).items():
        print(f"{key:<36} {s['median']:>8.4f}  {s['ci95']}  {s['ratios']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
