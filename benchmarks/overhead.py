"""Monitor overhead: throughput with gpulens vs without, and vs the PyTorch profiler.

Target (issue 2): at most 1% throughput loss for resnet50 in bf16 and for a launch-bound small
case (resnet18 at batch 8).

Two designs:
- ``--mode interleaved`` (default): one process, one model; short timed blocks of steps alternate
  plain / with gpulens's instrumentation (its step timer with CUDA events, and its sampler process
  at 10 Hz on the GPU and host) / under the PyTorch profiler, in ABC-CBA order. Pairs of adjacent
  blocks share clocks, caches and the model, so the per-pair loss is precise.
- ``--mode endtoend``: whole ``gpulens run`` trainings (run_training) against a plain loop with
  the same model and settings, a new model per trial: includes everything, but trial-to-trial
  noise of a launch-bound loop is several percent.

    python benchmarks/overhead.py [--mode interleaved|endtoend] [--rounds N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from gpulens.stats import t95
from gpulens.workloads.config import TrainConfig
from gpulens.workloads.models import get_workload
from gpulens.workloads.recipe import autocast_for, optimizer_for, synthetic_batches
from gpulens.workloads.train import run_training

CASES = {
    "resnet50_bf16_b256": dict(workload="resnet50", batch_size=256, precision="bf16"),
    "resnet18_fp32_b8": dict(workload="resnet18", batch_size=8, precision="fp32"),
}


def training_step(case: dict):
    """The training step ``gpulens run`` makes for ``case`` on synthetic on-device data:
    returns ``(step_fn(x, y), batches)``."""
    spec = get_workload(case["workload"])
    device = torch.device("cuda:0")
    model = spec.build().to(device).to(memory_format=torch.channels_last)
    model.train()
    opt = optimizer_for(spec, model)
    batches = synthetic_batches(spec, case["batch_size"], device, 0, torch.channels_last)

    def step_fn(x, y):
        with autocast_for(device, case["precision"]):
            loss = spec.loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step_fn, batches


def plain_loop(case: dict, steps: int, warmup: int, profiler: bool = False) -> float:
    """The same training step as ``gpulens run`` with no gpulens at all; samples/s."""
    step_fn, batches = training_step(case)

    def step():
        step_fn(*next(batches))

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    ctx = None
    if profiler:
        from torch.profiler import ProfilerActivity, profile

        ctx = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        ctx.__enter__()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    if ctx is not None:
        ctx.__exit__(None, None, None)
    return steps * case["batch_size"] / elapsed


_HOST = ("host", {"root_pid": os.getpid()})
# What the instrumented blocks run besides the step timer. "gpulens" is what `gpulens run` uses.
VARIANTS = {
    "gpulens": [("gpu", {"indices": [0]}), _HOST],
    "host_only": [_HOST],
    "energy_1hz": [("gpu", {"indices": [0], "energy_every_n": 10}), _HOST],
}


def interleaved(
    case: dict, blocks: int, steps_per_block: int, warmup: int, tmp: Path, variants: list[str]
) -> dict:
    """Alternate plain / gpulens / profiler blocks on one model; samples/s per block."""
    from torch.profiler import ProfilerActivity, profile

    from gpulens.probes.monitor import Monitor, ProbeSpec
    from gpulens.probes.steps import StepTimer
    from gpulens.record.schema import STEPS_SCHEMA
    from gpulens.record.writer import RunWriter

    batch = case["batch_size"]
    step_fn, batches = training_step(case)
    for _ in range(warmup):
        step_fn(*next(batches))
    torch.cuda.synchronize()

    def plain_block() -> float:
        t0 = time.perf_counter()
        for _ in range(steps_per_block):
            step_fn(*next(batches))
        torch.cuda.synchronize()
        return steps_per_block * batch / (time.perf_counter() - t0)

    def gpulens_block(variant: str) -> tuple[float, dict]:
        writer = RunWriter(tmp, kind="overhead")
        probes = [ProbeSpec(kind, opts) for kind, opts in VARIANTS[variant]]
        monitor = Monitor(writer, probes, hz=10.0).start()
        timer = StepTimer(writer.series("steps", STEPS_SCHEMA), cuda=True, warmup_steps=0)
        instrument_s = 0.0  # host time inside gpulens's per-step calls: a noise-free bound
        clock = time.perf_counter
        t0 = clock()
        for _ in range(steps_per_block):
            c = clock()
            timer.begin_step()
            instrument_s += clock() - c
            x, y = next(batches)
            c = clock()
            timer.batch_ready()
            timer.copy_done()
            instrument_s += clock() - c
            step_fn(x, y)
            c = clock()
            timer.end_step(samples=batch)
            instrument_s += clock() - c
        torch.cuda.synchronize()
        elapsed = clock() - t0
        rate = steps_per_block * batch / elapsed
        timer.finish()
        info = monitor.stop().as_dict()
        info["instrumentation_host_s_per_step"] = instrument_s / steps_per_block
        info["instrumentation_pct_of_step"] = 100.0 * instrument_s / elapsed
        writer.finish()
        return rate, info

    def profiler_block() -> float:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            rate = plain_block()
        return rate

    order = ["plain", *variants, "profiler"]
    out: dict[str, list] = {m: [] for m in order}
    out["monitor"] = []
    for b in range(blocks):
        for mode in order if b % 2 == 0 else order[::-1]:
            if mode == "plain":
                out["plain"].append(plain_block())
            elif mode == "profiler":
                out["profiler"].append(profiler_block())
            else:
                rate, info = gpulens_block(mode)
                out[mode].append(rate)
                if mode == "gpulens":
                    out["monitor"].append(info)
        rates = "  ".join(f"{m} {out[m][-1]:.1f}" for m in order)
        print(
            f"{case['workload']} b{batch} block {b}: {rates} samples/s", file=sys.stderr, flush=True
        )
    return out


def gpulens_loop(case: dict, steps: int, warmup: int, runs_root: Path) -> tuple[float, dict]:
    config = TrainConfig(
        steps=steps, warmup_steps=warmup, device="cuda:0", count_flops=False, **case
    )
    result = run_training(config, runs_root)
    s = result.summary
    return s["throughput_samples_per_s"], {
        "monitor_overhead_pct": s["monitor_overhead_pct"],
        "monitor_achieved_hz": s["monitor_achieved_hz"],
        "monitor_mean_sample_cost_ms": s["monitor_mean_sample_cost_ms"],
        "run_id": result.run_id,
    }


def loss_pct(base: list[float], other: list[float]) -> dict:
    """Throughput loss per round (paired), its mean and 95% CI half-width."""
    losses = [100.0 * (b - o) / b for b, o in zip(base, other, strict=True)]
    mean = statistics.fmean(losses)
    half = (
        t95(len(losses) - 1) * statistics.stdev(losses) / len(losses) ** 0.5
        if len(losses) > 1
        else None
    )
    return {"per_round_pct": losses, "mean_pct": mean, "ci95_half_width_pct": half}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["interleaved", "endtoend"], default="interleaved")
    ap.add_argument("--rounds", type=int, default=8, help="blocks (interleaved) or trials")
    ap.add_argument("--block-s", type=float, default=2.5, help="target seconds per block")
    ap.add_argument("--steps-r50", type=int, default=150)
    ap.add_argument("--steps-r18", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--variants", default="gpulens", help=f"instrumented variants, from {', '.join(VARIANTS)}"
    )
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of cases")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("overhead.py needs a CUDA GPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0)
    steps = {"resnet50_bf16_b256": args.steps_r50, "resnet18_fp32_b8": args.steps_r18}
    results = {}
    # steps per block from a rough rate, so that each block lasts about --block-s
    rough_steps_per_s = {"resnet50_bf16_b256": 15.0, "resnet18_fp32_b8": 80.0}
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in CASES.items():
            if name not in args.cases.split(","):
                continue
            if args.mode == "interleaved":
                n = max(10, int(args.block_s * rough_steps_per_s[name]))
                r = interleaved(
                    case, args.rounds, n, args.warmup, Path(tmp), args.variants.split(",")
                )
                results[name] = {
                    "case": case,
                    "steps_per_block": n,
                    "plain_samples_per_s": r["plain"],
                    "gpulens_samples_per_s": r["gpulens"],
                    "profiler_samples_per_s": r["profiler"],
                    "gpulens_loss": loss_pct(r["plain"], r["gpulens"]),
                    "profiler_loss": loss_pct(r["plain"], r["profiler"]),
                    "gpulens_self_reported": r["monitor"],
                    "variants": {
                        v: {"samples_per_s": r[v], "loss": loss_pct(r["plain"], r[v])}
                        for v in args.variants.split(",")
                    },
                }
                continue
            base, lens, prof, extra = [], [], [], []
            for r in range(args.rounds):
                base.append(plain_loop(case, steps[name], args.warmup))
                t, info = gpulens_loop(case, steps[name], args.warmup, Path(tmp))
                lens.append(t)
                extra.append(info)
                prof.append(plain_loop(case, steps[name], args.warmup, profiler=True))
                print(
                    f"{name} round {r}: plain {base[-1]:.1f}  gpulens {lens[-1]:.1f}  "
                    f"profiler {prof[-1]:.1f} samples/s",
                    file=sys.stderr,
                    flush=True,
                )
            results[name] = {
                "case": case,
                "steps": steps[name],
                "plain_samples_per_s": base,
                "gpulens_samples_per_s": lens,
                "profiler_samples_per_s": prof,
                "gpulens_loss": loss_pct(base, lens),
                "profiler_loss": loss_pct(base, prof),
                "gpulens_self_reported": extra,
            }
    doc = {
        "benchmark": "overhead",
        "mode": args.mode,
        "date": date.today().isoformat(),
        "gpu": gpu,
        "torch": torch.__version__,
        "command": " ".join(["python", *sys.argv]),
        "target_max_loss_pct": 1.0,
        "results": results,
    }
    out = args.out or Path(
        os.environ.get("OUT", "benchmarks/results"),
        f"overhead-{args.mode}-{gpu.replace(' ', '_')}-{date.today().isoformat()}.json",
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    for name, r in results.items():
        bound = [m.get("instrumentation_pct_of_step") for m in r["gpulens_self_reported"]]
        if all(b is not None for b in bound):
            losses = sorted(r["gpulens_loss"]["per_round_pct"])
            print(
                f"{name}: median paired loss {statistics.median(losses):.2f}%, "
                f"instrumentation on the training thread {statistics.fmean(bound):.3f}% of step"
            )
    print(f"\n{'case':<22}{'plain':>10}{'gpulens':>10}{'loss %':>16}{'profiler loss %':>18}")
    for name, r in results.items():
        g, p = r["gpulens_loss"], r["profiler_loss"]
        gh = g["ci95_half_width_pct"] or 0.0
        print(
            f"{name:<22}{statistics.fmean(r['plain_samples_per_s']):>10.1f}"
            f"{statistics.fmean(r['gpulens_samples_per_s']):>10.1f}"
            f"{g['mean_pct']:>10.2f} ±{gh:<4.2f}{p['mean_pct']:>18.2f}"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
