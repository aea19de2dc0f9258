"""Host cost of gpulens's per-step timing on the training thread, call by call, on a GPU.

Each step launches a few small kernels (a launch-bound loop), so nothing waits on a full
queue and the times below are what the timer itself costs. No run-to-run noise enters: the
calls are timed one by one.

    python benchmarks/step_timer_cost.py [--steps 5000] [--out FILE]
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

import torch

from gpulens.probes.steps import StepTimer
from gpulens.record.schema import STEPS_SCHEMA
from gpulens.record.writer import RunWriter


def per_call_us(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e6 * (time.perf_counter() - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("step_timer_cost.py needs a CUDA GPU", file=sys.stderr)
        return 2
    x = torch.randn(256, 256, device="cuda")
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    ev[1].record()
    torch.cuda.synchronize()
    calls = {
        "event_create_us": per_call_us(lambda: torch.cuda.Event(enable_timing=True), 2000),
        "event_record_us": per_call_us(lambda: ev[1].record(), 2000),
        "event_query_us": per_call_us(lambda: ev[1].query(), 2000),
        "event_elapsed_time_us": per_call_us(lambda: ev[0].elapsed_time(ev[1]), 2000),
        "small_kernel_launch_us": per_call_us(lambda: x.add_(1.0), 2000),
    }
    torch.cuda.synchronize()

    def loop(timer: StepTimer | None) -> tuple[float, float]:
        inside = 0.0
        clock = time.perf_counter
        t0 = clock()
        for _ in range(args.steps):
            if timer is not None:
                c = clock()
                timer.begin_step()
                timer.batch_ready()
                timer.copy_done()
                inside += clock() - c
            for _ in range(5):
                x.mul_(0.999)
            if timer is not None:
                c = clock()
                timer.end_step(samples=8)
                inside += clock() - c
        torch.cuda.synchronize()
        return 1e6 * (clock() - t0) / args.steps, 1e6 * inside / args.steps

    with tempfile.TemporaryDirectory() as tmp:
        loop(None)
        plain_us, _ = loop(None)
        w = RunWriter(Path(tmp), kind="cost")
        timer = StepTimer(w.series("steps", STEPS_SCHEMA), cuda=True, warmup_steps=0)
        timed_us, inside_us = loop(timer)
        timer.finish()
        w.finish()
    doc = {
        "benchmark": "step_timer_cost",
        "date": date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": " ".join(["python", *sys.argv]),
        "calls": calls,
        "loop_step_us_plain": plain_us,
        "loop_step_us_timed": timed_us,
        "timer_us_per_step": inside_us,
    }
    out = args.out or Path(
        os.environ.get("OUT", "benchmarks/results"),
        f"step_timer_cost-{doc['gpu'].replace(' ', '_')}-{doc['date']}.json",
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    for k, v in calls.items():
        print(f"{k:<26}{v:8.2f}")
    print(f"{'timer per step (us)':<26}{inside_us:8.2f}")
    print(f"{'loop step plain / timed':<26}{plain_us:8.2f} / {timed_us:.2f} us")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
