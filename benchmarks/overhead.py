"""Monitor overhead: throughput with gpulens vs without, and vs the PyTorch profiler.

Target (issue 2): at most 1% throughput loss for resnet50 in bf16 and for a launch-bound small
case (resnet18 at batch 8). The three modes run interleaved for several rounds so that clock and
thermal drift hit all of them alike; the loss carries a 95% CI over the rounds.

    python benchmarks/overhead.py [--rounds 3] [--steps-r50 150] [--steps-r18 1500] [--out FILE]
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
from gpulens.workloads.models import get_workload
from gpulens.workloads.train import TrainConfig, _autocast, _optimizer, _synthetic_batches, run_training

CASES = {
    "resnet50_bf16_b256": dict(workload="resnet50", batch_size=256, precision="bf16"),
    "resnet18_fp32_b8": dict(workload="resnet18", batch_size=8, precision="fp32"),
}


def plain_loop(case: dict, steps: int, warmup: int, profiler: bool = False) -> float:
    """The same training step as ``gpulens run`` with no gpulens at all; samples/s."""
    spec = get_workload(case["workload"])
    device = torch.device("cuda:0")
    model = spec.build().to(device).to(memory_format=torch.channels_last)
    model.train()
    opt = _optimizer(spec, model)
    batches = _synthetic_batches(spec, case["batch_size"], device, 0, torch.channels_last)

    def step():
        x, y = next(batches)
        with _autocast(device, case["precision"]):
            loss = spec.loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

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
    losses = [100.0 * (b - o) / b for b, o in zip(base, other)]
    mean = statistics.fmean(losses)
    half = (
        t95(len(losses) - 1) * statistics.stdev(losses) / len(losses) ** 0.5
        if len(losses) > 1
        else None
    )
    return {"per_round_pct": losses, "mean_pct": mean, "ci95_half_width_pct": half}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps-r50", type=int, default=150)
    ap.add_argument("--steps-r18", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("overhead.py needs a CUDA GPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0)
    steps = {"resnet50_bf16_b256": args.steps_r50, "resnet18_fp32_b8": args.steps_r18}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in CASES.items():
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
        "date": date.today().isoformat(),
        "gpu": gpu,
        "torch": torch.__version__,
        "command": " ".join(["python", *sys.argv]),
        "target_max_loss_pct": 1.0,
        "results": results,
    }
    out = args.out or Path(
        os.environ.get("OUT", "benchmarks/results"),
        f"overhead-{gpu.replace(' ', '_')}-{date.today().isoformat()}.json",
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
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
