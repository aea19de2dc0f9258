"""The cost of measuring a launch-bound loop (issue 19): gpulens against a plain PyTorch loop.

One process, one GPU. For each case (resnet18 bf16 at batch 1, 8 and 64, resnet50 bf16 at 256)
whole trials run in adjacent pairs, a plain-loop trial next to each other arm's trial, the
order alternating from pair to pair (AB, BA, ...), so slow drift of the host cancels:

- ``plain``: a plain PyTorch loop written as a user would (the torchvision model, channels_last,
  bf16 autocast, SGD with momentum, ``zero_grad(set_to_none=True)``), no gpulens at all;
- ``gpulens``: ``run_training`` -- exactly what ``gpulens run WORKLOAD --data synthetic`` runs
  (record, sampler process at 10 Hz on the GPU and host, step timer, progress callback);
- ``tracker``: the same plain loop inside ``gpulens.track()`` with ``tracker.data()`` and
  ``tracker.step()`` (the tracking API's own run: record, sampler, step timer);
- variants of the ``gpulens`` arm, to find what costs (``--ablations``): ``every_step`` (CUDA
  events on every step, as before issue 19), ``no_gpu_probe`` (the sampler samples the host
  only: no NVML calls), ``no_sampler`` (no sampler process), ``host_timer`` (the step timer
  without CUDA events), ``bare`` (no sampler, no CUDA events), ``no_flops`` (no FLOP count on
  the first warm-up step), ``no_progress`` (no progress callback).

Every arm runs the same number of steps after the same warm-up; throughput is measured steps x
batch / measured wall time (synchronised at both ends) for every arm, so the arms are timed alike.
The ratio arm / plain is taken per pair (each arm against its own adjacent plain trial); the
table gives the median and a 95% t-interval of the ratios.

With ``--blocks N`` each case also runs N pairs of short blocks (``--block-s``) on one model,
plain and instrumented alternating: the precise figure for the per-step cost, which whole
trials on a shared host (+-10% from trial to trial) cannot resolve to 1%.

    python benchmarks/launch_overhead.py --out results.json [--pairs 5] [--trial-s 3]
        [--blocks 30 --block-s 0.5]
        [--cases r18_b1,r18_b8,r18_b64,r50_b256] [--ablations r18_b1,r18_b8]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

CASES = {
    "r18_b1": dict(workload="resnet18", batch_size=1),
    "r18_b8": dict(workload="resnet18", batch_size=8),
    "r18_b64": dict(workload="resnet18", batch_size=64),
    "r50_b256": dict(workload="resnet50", batch_size=256),
}
MIN_WARMUP_STEPS = 30
# Warm-up long enough for the GPU's clocks to leave idle between trials (they fall while the
# next model is built), the same for every arm.
WARMUP_S = 1.0
DEVICE = torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


# ------------------------------------------------------------------------------ the plain loop
def plain_parts(workload: str, batch: int, seed: int = 0):
    """Model, optimizer and a few on-device batches, as a user would write them."""
    from gpulens.workloads.models import get_workload

    spec = get_workload(workload)  # only for the torchvision constructor and input shape
    torch.manual_seed(seed)
    model = spec.build().to(DEVICE).to(memory_format=torch.channels_last)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    pool = []
    for _ in range(4):
        x = torch.randn((batch, *spec.input_shape), generator=g).to(DEVICE)
        y = torch.randint(0, spec.num_classes, (batch,), generator=g).to(DEVICE)
        pool.append((x.contiguous(memory_format=torch.channels_last), y))
    return model, opt, pool


def plain_step(model, opt, x, y):
    with torch.autocast(device_type=DEVICE.type, dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def warmed_parts(case: dict, warmup_s: float = 0.0):
    """:func:`plain_parts` after the case's warm-up steps (and plain steps for at least
    ``warmup_s`` seconds more), with the plain step's time over 50 steps."""
    model, opt, pool = plain_parts(case["workload"], case["batch_size"])
    for i in range(case["warmup_steps"]):
        plain_step(model, opt, *pool[i % len(pool)])
    sync()
    t0, warm = time.perf_counter(), 0
    while time.perf_counter() - t0 < warmup_s:  # clocks up, allocator settled
        plain_step(model, opt, *pool[warm % len(pool)])
        warm += 1
    sync()
    t0 = time.perf_counter()
    for i in range(50):
        plain_step(model, opt, *pool[i % len(pool)])
    sync()
    return model, opt, pool, (time.perf_counter() - t0) / 50


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def run_plain(case: dict, steps: int) -> dict:
    model, opt, pool = plain_parts(case["workload"], case["batch_size"])
    for i in range(case["warmup_steps"]):
        plain_step(model, opt, *pool[i % len(pool)])
    sync()
    t0 = time.perf_counter()
    for i in range(steps):
        plain_step(model, opt, *pool[i % len(pool)])
    sync()
    wall_s = time.perf_counter() - t0
    return {"samples_per_s": steps * case["batch_size"] / wall_s, "wall_s": wall_s}


def run_tracker(case: dict, steps: int, runs_root: Path) -> dict:
    import gpulens

    os.environ["GPULENS_HOME"] = str(runs_root)
    model, opt, pool = plain_parts(case["workload"], case["batch_size"])
    warmup = case["warmup_steps"]
    total = warmup + steps

    def batches():
        for i in range(total):
            yield pool[i % len(pool)]

    t0 = None
    with gpulens.track(name="overhead-tracker", store=False) as tracker:
        for i, (x, y) in enumerate(tracker.data(batches())):
            if i == warmup:
                sync()
                t0 = time.perf_counter()
            plain_step(model, opt, x, y)
            tracker.step()
        sync()
        wall_s = time.perf_counter() - t0
    summary = dict(tracker.summary() or {}) if hasattr(tracker, "summary") else {}
    return {
        "samples_per_s": steps * case["batch_size"] / wall_s,
        "wall_s": wall_s,
        "tracking_us_per_step": summary.get("tracking_us_per_step"),
    }


# ------------------------------------------------------------------------------ gpulens run
@contextlib.contextmanager
def ablated(arm: str):
    """Patch what the ``gpulens`` arm runs without; nothing for ``gpulens`` itself."""
    import gpulens.workloads.train as train
    from gpulens.probes.steps import StepTimer
    from gpulens.run.lifecycle import RunSession

    saved: list[tuple[Any, str, Any]] = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    if arm in ("no_sampler", "bare"):

        class _NoMonitor:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def overhead(self):
                class _O:
                    def as_dict(self):
                        return {}

                return _O()

        def monitor(self, probes, hz=10.0):
            self._monitor = _NoMonitor()
            return self._monitor

        patch(RunSession, "monitor", monitor)
    if arm == "no_gpu_probe":
        patch(train, "nvml_index_for", lambda device: None)
    if arm == "every_step":

        class EveryStepTimer(StepTimer):
            def __init__(self, series, cuda, warmup_steps):
                super().__init__(series, cuda=cuda, warmup_steps=warmup_steps, gpu_every=1)

        patch(train, "StepTimer", EveryStepTimer)
    if arm in ("host_timer", "bare"):

        class HostTimer(StepTimer):
            def __init__(self, series, cuda, warmup_steps):
                super().__init__(series, cuda=False, warmup_steps=warmup_steps)

        patch(train, "StepTimer", HostTimer)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def run_gpulens(case: dict, steps: int, runs_root: Path, arm: str = "gpulens") -> dict:
    from rich.console import Console

    from gpulens.report.progress import ProgressReporter
    from gpulens.workloads.config import TrainConfig
    from gpulens.workloads.train import run_training

    config = TrainConfig(
        case["workload"],
        batch_size=case["batch_size"],
        steps=steps,
        warmup_steps=case["warmup_steps"],
        precision="bf16",
        data="synthetic",
        device=str(DEVICE),
        name=f"overhead-{arm}",
        count_flops=arm != "no_flops",
    )
    # The CLI's progress off a terminal (what a batch job, a notebook or this call sees).
    console = Console(file=io.StringIO(), force_terminal=False)
    with ProgressReporter(console, "run", live=False, unit="steps") as progress:

        def on_step(step, total, elapsed_s, info):
            progress.count(step, total)

        with ablated(arm):
            callback = None if arm == "no_progress" else on_step
            result = run_training(config, runs_root, progress=callback)
    s = result.summary
    wall_s = s["measured_wall_s"]
    return {
        "samples_per_s": steps * case["batch_size"] / wall_s,
        "wall_s": wall_s,
        "summary_samples_per_s": s.get("throughput_samples_per_s"),
        "tracking_us_per_step": s.get("tracking_us_per_step"),
        "sampler_cpu_pct_of_core": s.get("sampler_cpu_pct_of_core"),
        "gpu_timing_every_n_steps": s.get("gpu_timing_every_n_steps"),
        "record_dir": str(result.record_dir),
    }


# ------------------------------------------------------------------------------ short blocks
def sm_clock_reader():
    """A function returning the GPU's current SM clock in MHz (None without NVML): read
    between blocks, never inside one, to see whether the launch-bound loop's block-to-block
    spread follows the clock (the GPU idles between small kernels and may clock down)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(DEVICE.index or 0)
    except Exception:
        return lambda: None

    def read() -> float | None:
        try:
            return float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
        except Exception:
            return None

    return read if DEVICE.type == "cuda" else (lambda: None)


# Seconds a sampler started for a block runs before the block is timed (3 samples at 10 Hz).
SAMPLER_SETTLE_S = 0.3


def run_blocks(
    case: dict,
    pairs: int,
    block_s: float,
    runs_root: Path,
    gpu_every: int | None = None,
    host_timer: bool = False,
    sampler_throughout: bool = False,
    sampler_only: str | None = None,
) -> dict:
    """One model; short blocks alternate plain / instrumented (ABBA), so host drift, which
    moves whole trials by +-10% on a shared host, cancels within a pair. Instrumented = what
    ``gpulens run`` adds per step: the sampler process (GPU and host probes at 10 Hz, started
    and stopped outside the timed block), the step timer writing its series, the loop's checks.
    One step timer serves all instrumented blocks, so it is calibrated once, as in a run.
    ``sampler_throughout``: the sampler runs across all blocks, plain ones too, so the blocks
    differ by the step timer alone (its cost, free of the sampler's start-up).
    ``host_timer``: the step timer without CUDA events (as the tracking API times), so that
    against the timer-only blocks the events' share of the cost shows.
    ``sampler_only``: instrumented = the plain step with only a sampler running (started
    outside the timed block): ``host`` (host probe), ``gpu_no_gpm`` (GPU probe without GPM, and
    the host), ``gpu`` (both probes, as in a run: GPM once a second), ``gpu_gpm10hz`` (GPM at
    every 10 Hz sample, as before 838a8f6): what each part of the sampler costs."""
    from gpulens.probes.monitor import Monitor, ProbeSpec
    from gpulens.probes.steps import StepTimer
    from gpulens.record.schema import STEPS_SCHEMA
    from gpulens.record.writer import RunWriter

    model, opt, pool, step_s = warmed_parts(case)
    batch = case["batch_size"]
    steps = max(20, int(block_s / step_s))
    writer = RunWriter(runs_root, kind="overhead", name="blocks")
    series = writer.series("steps", STEPS_SCHEMA, background=True)  # as gpulens run writes it
    cuda_timer = DEVICE.type == "cuda" and not host_timer  # host_timer: no CUDA events at all
    timer = StepTimer(series, cuda=cuda_timer, warmup_steps=0, gpu_every=gpu_every)
    probes = [ProbeSpec("host", {"root_pid": os.getpid()})]
    if DEVICE.type == "cuda" and sampler_only != "host":
        gpu_options: dict[str, Any] = {"indices": [DEVICE.index or 0]}
        if sampler_only == "gpu_no_gpm":
            gpu_options["gpm"] = False
        if sampler_only == "gpu_gpm10hz":  # GPM at every sample, as before GPM_INTERVAL_S
            gpu_options["gpm_min_interval_s"] = 0.09
        probes.insert(0, ProbeSpec("gpu", gpu_options))

    background = Monitor(writer, probes, hz=10.0).start() if sampler_throughout else None

    def block(instrumented: bool) -> tuple[float, float, float]:
        """(samples/s, median host step s, share of the block's time in stalled steps)."""
        start_sampler = instrumented and background is None
        monitor = Monitor(writer, probes, hz=10.0).start() if start_sampler else None
        if monitor is not None:
            # a run's sampler is long past its first samples when steps are measured: let this
            # one take a few (opening GPM windows, first reads) outside the timed block
            time.sleep(SAMPLER_SETTLE_S)
        marks = [0.0] * steps  # host clock after each step's issue: the same in both arms
        sync()
        start = time.perf_counter()
        for i in range(steps):
            if instrumented and sampler_only is None:
                timer.begin_step()
                x, y = pool[i % len(pool)]
                timer.batch_ready()
                timer.copy_done()
                plain_step(model, opt, x, y)
                timer.end_step(samples=batch)
            else:
                plain_step(model, opt, *pool[i % len(pool)])
            marks[i] = time.perf_counter()
        sync()
        wall_s = time.perf_counter() - start
        rate = steps * batch / wall_s
        if monitor is not None:
            monitor.stop()
        # A launch-bound step's host time is its step time. The median is the per-step cost;
        # steps over twice it are stalls (the host descheduled or waiting), whose share of the
        # block says whether a cost comes as a slower step or as more stalls.
        step_s = [b - a for a, b in zip([start, *marks[:-1]], marks, strict=True)]
        median_s = statistics.median(step_s)
        stalled_s = sum(s for s in step_s if s > 2 * median_s)
        return rate, median_s, stalled_s / wall_s

    ratios, plain_rates, inst_rates = [], [], []
    median_ratios: list[float] = []
    stall_share: dict[bool, list[float]] = {False: [], True: []}
    clock = sm_clock_reader()
    clocks: dict[bool, list[float | None]] = {False: [], True: []}
    for pair in range(pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        got = {}
        for flag in order:
            got[flag] = block(flag)
            clocks[flag].append(clock())  # just after the block, outside its timing
            stall_share[flag].append(round(got[flag][2], 4))
        plain_rates.append(got[False][0])
        inst_rates.append(got[True][0])
        ratios.append(got[True][0] / got[False][0])
        median_ratios.append(got[False][1] / got[True][1])  # as throughput: > 1 is faster
    timer.finish()
    if background is not None:
        background.stop()
    writer.finish()
    return {
        "sampler_throughout": sampler_throughout,
        "sampler_only": sampler_only,
        "steps_per_block": steps,
        "plain_samples_per_s": [round(r, 2) for r in plain_rates],
        "instrumented_samples_per_s": [round(r, 2) for r in inst_rates],
        "ratio_to_plain": [round(r, 4) for r in ratios],
        "sm_clock_mhz_after_plain": clocks[False],
        "sm_clock_mhz_after_instrumented": clocks[True],
        "ratio_median": round(statistics.median(ratios), 4),
        "ratio_mean": round(statistics.fmean(ratios), 4),
        "ratio_ci95": interval95(ratios),
        # the same pairs by their median step (plain over instrumented): free of stalls
        "median_step_ratio_to_plain": [round(r, 4) for r in median_ratios],
        "median_step_ratio_median": round(statistics.median(median_ratios), 4),
        "median_step_ratio_ci95": interval95(median_ratios),
        "stall_share_plain": stall_share[False],
        "stall_share_instrumented": stall_share[True],
        "tracking_us_per_step": timer.tracking_us_per_step(),
        "gpu_timing_every_n_steps": timer.gpu_timing_every_n_steps,
    }


# ------------------------------------------------------------------------------ statistics
def interval95(xs: list[float]) -> list[float] | None:
    from gpulens.stats import t95

    if len(xs) < 2:
        return None
    m, sd = statistics.fmean(xs), statistics.stdev(xs)
    h = t95(len(xs) - 1) * sd / len(xs) ** 0.5
    return [round(m - h, 4), round(m + h, 4)]


def calibrate_steps(case: dict, trial_s: float) -> tuple[int, int]:
    """(measured steps, warm-up steps) for a trial of about ``trial_s`` seconds of the plain
    loop after ``WARMUP_S`` seconds of warm-up."""
    probe = run_plain({**case, "warmup_steps": MIN_WARMUP_STEPS}, 100)
    step_s = case["batch_size"] / probe["samples_per_s"]
    return max(50, int(trial_s / step_s)), max(MIN_WARMUP_STEPS, int(WARMUP_S / step_s))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--ablations", default="r18_b8", help="cases with the variant arms")
    ap.add_argument(
        "--variants", default="every_step,no_sampler,host_timer", help="variant arms to run"
    )
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--trial-s", type=float, default=3.0)
    ap.add_argument("--no-tracker", action="store_true")
    ap.add_argument(
        "--blocks",
        type=int,
        default=0,
        help="also this many pairs of short plain/instrumented blocks on one model per case",
    )
    ap.add_argument("--block-s", type=float, default=0.5)
    ap.add_argument("--no-whole-runs", action="store_true", help="only the blocks")
    ap.add_argument(
        "--sampler-blocks",
        default="",
        help="sampler-only block modes to run (host,gpu_no_gpm,gpu,gpu_gpm10hz): the plain step "
        "against "
        "the plain step with only that sampler running",
    )
    ap.add_argument("--no-timer-blocks", action="store_true", help="skip the blocks of --blocks")
    ap.add_argument(
        "--host-timer-blocks",
        action="store_true",
        help="also blocks with the step timer on the host only (no CUDA events), sampler "
        "throughout: against timer_only, what the events cost",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.setdefault("GPULENS_STORE", "0")
    cases = [c for c in args.cases.split(",") if c]
    ablation_cases = {c for c in args.ablations.split(",") if c}
    gpu = torch.cuda.get_device_name(0) if DEVICE.type == "cuda" else platform.processor()
    doc: dict[str, Any] = {
        "benchmark": "launch_overhead",
        "date": date.today().isoformat(),
        "gpu": gpu,
        "torch": torch.__version__,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "warmup_s": WARMUP_S,
        "pairs": args.pairs,
        "cases": {},
    }
    tmp = Path(tempfile.mkdtemp(prefix="gpulens-overhead-"))
    for name in cases:
        steps, warmup = calibrate_steps(CASES[name], args.trial_s)
        case = {**CASES[name], "warmup_steps": warmup}
        arms = ["gpulens"] + ([] if args.no_tracker else ["tracker"])
        if name in ablation_cases:
            arms += [v for v in args.variants.split(",") if v]
        trials: dict[str, list[dict]] = {a: [] for a in arms}
        plain: dict[str, list[dict]] = {a: [] for a in arms}  # each arm's adjacent plain trials
        print(f"{name}: {steps} steps per trial after {warmup}, arms {arms}", flush=True)
        for pair in range(0 if args.no_whole_runs else args.pairs):
            for arm in arms:
                for which in ("plain", arm) if pair % 2 == 0 else (arm, "plain"):
                    if which == "plain":
                        r = run_plain(case, steps)
                    elif which == "tracker":
                        r = run_tracker(case, steps, tmp / "home")
                    else:
                        r = run_gpulens(case, steps, tmp / "runs", which)
                    r["pair"] = pair
                    (plain if which == "plain" else trials)[arm].append(r)
                rate, ref = trials[arm][-1]["samples_per_s"], plain[arm][-1]["samples_per_s"]
                print(f"  pair {pair} {arm:>12}: {rate:9.1f} vs plain {ref:9.1f}", flush=True)
        out = {"steps_per_trial": steps, **case, "precision": "bf16", "arms": {}}
        for arm in [a for a in arms if trials[a]]:
            rates = [t["samples_per_s"] for t in trials[arm]]
            refs = [t["samples_per_s"] for t in plain[arm]]
            ratios = [r / p for r, p in zip(rates, refs, strict=True)]
            out["arms"][arm] = {
                "samples_per_s": [round(r, 2) for r in rates],
                "plain_samples_per_s": [round(r, 2) for r in refs],
                "ratio_to_plain": [round(r, 4) for r in ratios],
                "ratio_median": round(statistics.median(ratios), 4),
                "ratio_mean": round(statistics.fmean(ratios), 4),
                "ratio_ci95": interval95(ratios),
                "tracking_us_per_step": [t.get("tracking_us_per_step") for t in trials[arm]],
                "sampler_cpu_pct_of_core": [t.get("sampler_cpu_pct_of_core") for t in trials[arm]],
                "gpu_timing_every_n_steps": [
                    t.get("gpu_timing_every_n_steps") for t in trials[arm]
                ],
            }
        for mode in [m for m in args.sampler_blocks.split(",") if m]:
            key = f"blocks_sampler_{mode}"
            out[key] = run_blocks(
                case, args.blocks, args.block_s, tmp / "blocks", sampler_only=mode
            )
            b = out[key]
            print(f"  {key}: ratio {b['ratio_median']} {b['ratio_ci95']}", flush=True)
        if args.blocks and not args.no_timer_blocks:
            out["blocks"] = run_blocks(case, args.blocks, args.block_s, tmp / "blocks")
            out["blocks_timer_only"] = run_blocks(
                case, args.blocks, args.block_s, tmp / "blocks", sampler_throughout=True
            )
            if args.host_timer_blocks:
                out["blocks_host_timer"] = run_blocks(
                    case,
                    args.blocks,
                    args.block_s,
                    tmp / "blocks",
                    sampler_throughout=True,
                    host_timer=True,
                )
            if name in ablation_cases and "every_step" in args.variants:
                out["blocks_every_step"] = run_blocks(
                    case, args.blocks, args.block_s, tmp / "blocks", gpu_every=1
                )
            b = out["blocks"]
            print(f"  blocks: ratio {b['ratio_median']} {b['ratio_ci95']}", flush=True)
        doc["cases"][name] = out
        Path(args.out).write_text(json.dumps(doc, indent=2))  # finished cases survive a limit
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(f"\n{gpu}, {args.pairs} pairs, ratio = arm / plain loop (same pair)")
    head = ("case", "arm", "samples/s", "ratio", "95% interval", "us/step", "every")
    print(
        f"{head[0]:<9} {head[1]:>12} {head[2]:>10} {head[3]:>6} {head[4]:>16} {head[5]:>7} "
        f"{head[6]:>5}"
    )
    for name, out in doc["cases"].items():
        for arm, a in out["arms"].items():
            ci = a["ratio_ci95"]
            ci_s = f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "-"
            us = [u for u in a["tracking_us_per_step"] if u is not None]
            us_s = f"{statistics.median(us):.0f}" if us else "-"
            rate = statistics.median(a["samples_per_s"])
            every = [e for e in a["gpu_timing_every_n_steps"] if e is not None]
            ev_s = str(statistics.median(every)) if every else "-"
            print(
                f"{name:<9} {arm:>12} {rate:10.1f} {a['ratio_median']:6.3f} {ci_s:>16} "
                f"{us_s:>7} {ev_s:>5}"
            )
        labels = [k for k in out if k.startswith("blocks_sampler_")]
        for label in (
            "blocks",
            "blocks_timer_only",
            "blocks_host_timer",
            "blocks_every_step",
            *labels,
        ):
            if label not in out:
                continue
            b, ci = out[label], out[label]["ratio_ci95"]
            ci_s = f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "-"
            mci = b.get("median_step_ratio_ci95")
            mci_s = f"[{mci[0]:.3f}, {mci[1]:.3f}]" if mci else "-"
            stall = statistics.fmean(b["stall_share_instrumented"]) - statistics.fmean(
                b["stall_share_plain"]
            )
            rate = statistics.median(b["instrumented_samples_per_s"])
            print(
                f"{name:<9} {label.removeprefix('blocks_')[:12]:>12} {rate:10.1f} "
                f"{b['ratio_median']:6.3f} {ci_s:>16} "
                f"{b['tracking_us_per_step'] or 0:7.0f} {b['gpu_timing_every_n_steps'] or '-':>5}"
                f"  median step {b['median_step_ratio_median']:.3f} {mci_s}, stalls "
                f"{stall:+.1%} of the time"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
