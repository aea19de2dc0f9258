"""What each part of gpulens costs a launch-bound loop, to a fraction of a percent (issue 19).

Blocks of half a second (``launch_overhead.py --blocks``) cannot resolve 1%: the host's pace
drifts by a few percent from one block to the next. Here the two arms alternate every few steps
(chunks of about ``--chunk-s``, 50 ms) inside one loop on one model, in ABBA order, for
thousands of steps, and every step's host time is kept. A launch-bound step's host time is its
step time, so drift slower than a chunk cancels within each pair.

Arms (instrumented = the plain step plus):

- ``aa``: nothing. Plain against plain: the method's own spread, the null to compare with.
- ``timer``: the step timer as ``gpulens run`` uses it (CUDA events on a sample of steps,
  the steps series written), the sampler process running throughout both arms.
- ``host_timer``: the step timer without CUDA events (as the tracking API times).
- ``sampler``: the sampler process (GPU probe with GPM once a second, host probe, 10 Hz),
  running only in the instrumented chunks: it is stopped (SIGSTOP) at the start of each plain
  chunk and continued (SIGCONT) at the start of each instrumented one. It skips samples it
  missed rather than bursting, so while running it does its normal work.
- ``full``: the step timer and the sampler together, both toggled: what ``gpulens run`` adds.
- ``tracker``: ``tracker.data()`` and ``tracker.step()`` inside ``gpulens.track()`` (its
  sampler running throughout both arms).
- ``inject``: what ``gpulens run -- python train.py`` puts into an unmodified script
  (:mod:`gpulens.workloads.inject`): the batches come from a ``DataLoader`` in both arms, its
  own iterator in the plain chunks and the injected one in the others, and the global
  optimizer post-hook that ends each step is in place only in the instrumented chunks (the
  injected tracker's sampler running throughout both arms). Run last: the injection stays
  installed in the process.

Arms that take ``full`` apart (not run by default; ``--arms`` names them): ``full_host_timer``
(the timer without CUDA events), ``full_sparse`` (CUDA events on one step in 64),
``full_no_gpm`` (the GPU probe without GPM), ``full_host_probe`` (no NVML: the host probe only),
``full_gpu_probe`` (the GPU probe only), each with the sampler toggled as in ``full``;
``sampler_niced`` and ``full_niced``: ``sampler`` and ``full`` with the sampler process at
niceness 10. ``--busy-cpus N`` spins N processes beside the loop for the whole run: a busy
host, where the sampler's CPU time competes with the training thread's.

Figures per arm (throughput ratio instrumented / plain, > 1 is faster): ``ratio`` = plain
time / instrumented time over all chunks, with a 95% bootstrap interval over the pairs;
``median_ratio`` the same on the median step (free of stalls); ``cost_us_per_step`` the mean
difference in step time.

    python benchmarks/overhead_interleaved.py --out r.json [--cases r18_b1,r18_b8]
        [--arms aa,timer,host_timer,sampler,full,tracker,inject] [--seconds 25] [--chunk-s 0.05]
        [--busy-cpus N]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_overhead import CASES, DEVICE, plain_step, sync, warmed_parts  # noqa: E402


@dataclass(frozen=True)
class Arm:
    """What an arm adds to the plain step. ``timer``: None, "cuda" (events sampled as in a
    run), "host" (no events) or "cuda_sparse" (events on one step in 64). ``sampler``: the
    benchmark's own sampler process "throughout" both arms, "toggled" (instrumented chunks
    only) or None (the tracking API brings its own). ``probes``: what that sampler runs."""

    timer: str | None = None
    sampler: str | None = "throughout"
    probes: tuple[str, ...] = ("gpu", "host")
    api: str | None = None  # "tracker" or "inject"
    sampler_nice: int = 0  # the sampler process's niceness (every thread of it)


ARM_SPECS = {
    "aa": Arm(),
    "timer": Arm(timer="cuda"),
    "host_timer": Arm(timer="host"),
    "sampler": Arm(sampler="toggled"),
    "full": Arm(timer="cuda", sampler="toggled"),
    "tracker": Arm(sampler=None, api="tracker"),
    "inject": Arm(sampler=None, api="inject"),
    "full_host_timer": Arm(timer="host", sampler="toggled"),
    "full_sparse": Arm(timer="cuda_sparse", sampler="toggled"),
    "full_no_gpm": Arm(timer="cuda", sampler="toggled", probes=("gpu_no_gpm", "host")),
    "full_host_probe": Arm(timer="cuda", sampler="toggled", probes=("host",)),
    "full_gpu_probe": Arm(timer="cuda", sampler="toggled", probes=("gpu",)),
    "sampler_niced": Arm(sampler="toggled", sampler_nice=10),
    "full_niced": Arm(timer="cuda", sampler="toggled", sampler_nice=10),
}
ARMS = ("aa", "timer", "host_timer", "sampler", "full", "tracker", "inject")  # the default set
SPARSE_GPU_EVERY = 64
BOOTSTRAP = 2000
# Pairs run and dropped after the pause before measuring: the first chunk after it runs cold
# (on a CPU, 10 pairs of plain/plain read 1.03 with it kept).
WARM_PAIRS = 2
STALL_X = 3.0
SETTLE_STEPS = 40  # instrumented steps before measuring: the timer calibrates as in a run


def probe_specs(kinds: tuple[str, ...] = ("gpu", "host")) -> list:
    """The sampler's probes as ``gpulens run`` starts them on this machine (``kinds``: the
    subset, or "gpu_no_gpm" for the GPU probe with GPM off)."""
    from gpulens.probes.monitor import ProbeSpec

    probes = []
    if DEVICE.type == "cuda" and "gpu" in kinds:
        probes.append(ProbeSpec("gpu", {"indices": [DEVICE.index or 0]}))
    if DEVICE.type == "cuda" and "gpu_no_gpm" in kinds:
        probes.append(ProbeSpec("gpu", {"indices": [DEVICE.index or 0], "gpm": False}))
    if "host" in kinds:
        probes.append(ProbeSpec("host", {"root_pid": os.getpid()}))
    return probes


def renice(pid: int, nice: int) -> None:
    """Every thread of ``pid`` to ``nice`` (on Linux a process's niceness is per thread)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.setpriority(os.PRIO_PROCESS, int(task.name), nice)


def busy_cpus(count: int) -> list[subprocess.Popen]:
    """``count`` processes that spin on a CPU each: a busy host, as other jobs make one."""
    spin = [sys.executable, "-c", "while True: pass"]
    return [subprocess.Popen(spin) for _ in range(count)]


class Toggle:
    """Stops and continues a sampler process (None: nothing to toggle)."""

    def __init__(self, monitor) -> None:
        proc = getattr(monitor, "_proc", None) if monitor is not None else None
        self.pid = proc.pid if proc is not None else None

    def on(self) -> None:
        if self.pid is not None:
            os.kill(self.pid, signal.SIGCONT)

    def off(self) -> None:
        if self.pid is not None:
            os.kill(self.pid, signal.SIGSTOP)


class EndlessBatches(torch.utils.data.IterableDataset):
    """The on-device batches of the pool, round and round, for a ``DataLoader``."""

    def __init__(self, pool: list) -> None:
        self.pool = pool

    def __iter__(self):
        i = 0
        while True:
            yield self.pool[i % len(self.pool)]
            i += 1


class InjectedLoader:
    """One ``DataLoader`` with two iterators: its own (made before the injection goes in) and
    the injected one; ``on``/``off`` put the injection's optimizer post-hook in and take it out."""

    def __init__(self, pool: list) -> None:
        import torch.optim.optimizer as optimizer_module

        from gpulens.workloads import inject

        self._inject, self._optimizer_module = inject, optimizer_module
        loader = torch.utils.data.DataLoader(EndlessBatches(pool), batch_size=None)
        self.plain = iter(loader)
        os.environ[inject.INJECT_ENV] = "1"
        if not inject._state["installed"] and not inject.install():
            raise RuntimeError(f"injection not installed: {inject._state['failed']}")
        inject._state.update(tracker=None, steps=0, loader=None, pending_eval=False)
        self.on()  # an earlier case's arm took the hook out at its end
        self.injected = iter(loader)  # a new injected tracker for this arm
        if not isinstance(self.injected, inject._TimedLoaderIter):
            raise RuntimeError("the DataLoader's iterator was not injected")

    @property
    def tracker(self):
        return self._inject._state["tracker"]

    def on(self) -> None:
        if self._inject._state["step_hook"] is None:
            self._inject._hook_optimizer(self._optimizer_module)

    def off(self) -> None:
        hook = self._inject._state["step_hook"]
        if hook is not None:
            hook.remove()
            self._inject._state["step_hook"] = None


def interleave(
    case: dict, arm: str, seconds: float, chunk_s: float, root: Path, warmup_s: float = 1.0
) -> dict:
    """Runs one arm against the plain step, chunk by chunk; returns the step times."""
    import gpulens
    from gpulens.probes.monitor import Monitor
    from gpulens.probes.steps import StepTimer
    from gpulens.record.schema import STEPS_SCHEMA
    from gpulens.record.writer import RunWriter

    model, opt, pool, step_s = warmed_parts(case, warmup_s)
    batch = case["batch_size"]
    chunk = max(4, round(chunk_s / step_s))
    pairs = max(10, int(seconds / (2 * chunk * step_s)))

    spec = ARM_SPECS[arm]
    writer = RunWriter(root, kind="overhead", name=f"interleaved-{arm}")
    timer = None
    if spec.timer is not None:
        series = writer.series("steps", STEPS_SCHEMA, background=True)  # as in gpulens run
        timer = StepTimer(
            series,
            cuda=DEVICE.type == "cuda" and spec.timer != "host",
            warmup_steps=0,
            gpu_every=SPARSE_GPU_EVERY if spec.timer == "cuda_sparse" else None,
        )
    monitor = None
    if spec.sampler is not None:
        monitor = Monitor(writer, probe_specs(spec.probes), hz=10.0).start()
    toggle = Toggle(monitor if spec.sampler == "toggled" else None)
    if spec.sampler_nice and monitor is not None:
        renice(monitor._proc.pid, spec.sampler_nice)
    injected = InjectedLoader(pool) if spec.api == "inject" else None
    if injected is not None:
        plain_batches = injected.plain

        def plain_batch(i: int):
            return next(plain_batches)

        toggle = injected  # the hook is in only in the instrumented chunks
    else:

        def plain_batch(i: int):
            return pool[i % len(pool)]

    tracker_ctx = tracker = tracked = None
    if spec.api == "tracker":
        tracker_ctx = gpulens.track(name="overhead-interleaved", store=False)
        tracker = tracker_ctx.__enter__()

        def endless():
            i = 0
            while True:
                yield pool[i % len(pool)]
                i += 1

        tracked = iter(tracker.data(endless()))

    def instrumented_step(i: int) -> None:
        if timer is not None:
            timer.begin_step()
            x, y = pool[i % len(pool)]
            timer.batch_ready()
            timer.copy_done()
            plain_step(model, opt, x, y)
            timer.end_step(samples=batch)
        elif tracked is not None:
            x, y = next(tracked)
            plain_step(model, opt, x, y)
            tracker.step()
        elif injected is not None:  # the optimizer's post-hook ends the step
            plain_step(model, opt, *next(injected.injected))
        else:  # aa, sampler: the plain step
            plain_step(model, opt, *plain_batch(i))

    if timer is not None or injected is not None:  # calibrated as in a run, before measuring
        for i in range(SETTLE_STEPS):
            instrumented_step(i)
    time.sleep(0.3)  # the sampler past its first samples
    sync()
    plain_s: list[list[float]] = []
    inst_s: list[list[float]] = []
    clock = time.perf_counter
    step = 0
    for pair in range(-WARM_PAIRS, pairs):  # the first pairs, after the pause, are dropped
        order = (False, True) if pair % 2 == 0 else (True, False)
        for instrumented in order:
            (toggle.on if instrumented else toggle.off)()
            times = [0.0] * chunk
            last = clock()
            for k in range(chunk):
                if instrumented:
                    instrumented_step(step)
                else:
                    plain_step(model, opt, *plain_batch(step))
                now = clock()
                times[k] = now - last
                last = now
                step += 1
            if pair >= 0:
                (inst_s if instrumented else plain_s).append(times)
    toggle.on()
    sync()
    result: dict[str, Any] = {"chunk_steps": chunk, "pairs": pairs}
    if injected is not None:
        injected_steps = SETTLE_STEPS + (pairs + WARM_PAIRS) * chunk
        result["steps_instrumented"] = injected_steps  # the tracker's count must match it
    if timer is not None:
        timer.finish()
        result["tracking_us_per_step"] = timer.tracking_us_per_step()
        result["gpu_timing_every_n_steps"] = timer.gpu_timing_every_n_steps
    if monitor is not None:
        result["sampler_cpu_pct_of_core"] = monitor.stop().as_dict().get("sampler_cpu_pct_of_core")
    if tracker_ctx is not None:
        summary = dict(tracker.summary() or {})
        tracker_ctx.__exit__(None, None, None)
        result["tracking_us_per_step"] = summary.get("tracking_us_per_step")
    if injected is not None:
        injected.off()  # the next arm's optimizer steps are not this tracker's
        summary = dict(injected.tracker.summary() or {})
        injected.tracker.close()
        result["tracking_us_per_step"] = summary.get("tracking_us_per_step")
        result["steps_tracked"] = summary.get("steps_total")
    writer.finish()
    result.update(summarize(np.array(plain_s), np.array(inst_s), batch))
    return result


def summarize(plain_s: np.ndarray, inst_s: np.ndarray, batch: int, seed: int = 0) -> dict:
    """Ratios of the two arms' step times (pairs x chunk arrays), with bootstrap intervals
    over the pairs: the pairs are the independent units, the steps within one are not."""
    rng = np.random.default_rng(seed)
    n = len(plain_s)
    picks = rng.integers(0, n, size=(BOOTSTRAP, n))
    plain_sum, inst_sum = plain_s.sum(axis=1), inst_s.sum(axis=1)
    ratio = plain_sum.sum() / inst_sum.sum()
    boot = plain_sum[picks].sum(axis=1) / inst_sum[picks].sum(axis=1)
    # the median step per pair and arm, then the ratio of their medians: robust to stalls
    plain_med, inst_med = np.median(plain_s, axis=1), np.median(inst_s, axis=1)
    median_ratio = np.median(plain_med) / np.median(inst_med)
    boot_med = np.median(plain_med[picks], axis=1) / np.median(inst_med[picks], axis=1)
    cost_s = (inst_sum - plain_sum) / plain_s.shape[1]
    return {
        "ratio": round(float(ratio), 4),
        "ratio_ci95": [round(float(q), 4) for q in np.quantile(boot, [0.025, 0.975])],
        "median_ratio": round(float(median_ratio), 4),
        "median_ratio_ci95": [round(float(q), 4) for q in np.quantile(boot_med, [0.025, 0.975])],
        "cost_us_per_step": round(float(cost_s.mean() * 1e6), 2),
        "plain_step_ms": round(float(plain_s.mean() * 1e3), 4),
        "instrumented_step_ms": round(float(inst_s.mean() * 1e3), 4),
        "plain_samples_per_s": round(float(batch / plain_s.mean()), 2),
        "steps_per_arm": int(plain_s.size),
        # per pair, in order: each chunk's mean step (ms), to look for drift or stalls later
        "pair_plain_step_ms": [round(float(x), 4) for x in plain_s.mean(axis=1) * 1e3],
        "pair_instrumented_step_ms": [round(float(x), 4) for x in inst_s.mean(axis=1) * 1e3],
        # steps over STALL_X times their arm's median: [pair, step in chunk, ms], per arm
        "stalls_plain": stalls(plain_s),
        "stalls_instrumented": stalls(inst_s),
    }


def stalls(steps_s: np.ndarray) -> list[list[float]]:
    """Steps over :data:`STALL_X` times the median step: where a cost comes as stalls."""
    limit = STALL_X * float(np.median(steps_s))
    return [
        [int(p), int(k), round(float(steps_s[p, k]) * 1e3, 3)]
        for p, k in zip(*np.nonzero(steps_s > limit), strict=True)
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="r18_b1,r18_b8")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seconds", type=float, default=25.0, help="measured time per arm and case")
    ap.add_argument("--chunk-s", type=float, default=0.05)
    ap.add_argument("--warmup-s", type=float, default=1.0)
    ap.add_argument("--busy-cpus", type=int, default=0,
                    help="spin this many processes beside the loop (a busy host)")  # fmt: skip
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARM_SPECS]
    if unknown:
        ap.error(f"unknown arm(s) {unknown}: use {', '.join(ARM_SPECS)}")
    spinners = busy_cpus(args.busy_cpus)
    try:
        return measure(args, arms)
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def measure(args: argparse.Namespace, arms: list[str]) -> int:
    os.environ.setdefault("GPULENS_STORE", "0")
    arms.sort(key=lambda a: ARM_SPECS[a].api == "inject")  # the injection stays: run it last
    gpu = torch.cuda.get_device_name(0) if DEVICE.type == "cuda" else "cpu"
    doc: dict[str, Any] = {
        "benchmark": "overhead_interleaved",
        "date": date.today().isoformat(),
        "gpu": gpu,
        "torch": torch.__version__,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "busy_cpus": args.busy_cpus,
        "cpus": os.cpu_count(),
        "cases": {},
    }
    root = Path(tempfile.mkdtemp(prefix="gpulens-interleaved-"))
    os.environ.setdefault("GPULENS_HOME", str(root / "home"))
    for name in [c for c in args.cases.split(",") if c]:
        doc["cases"][name] = {}
        for arm in arms:
            case = {**CASES[name], "warmup_steps": 30}
            t0 = time.perf_counter()
            r = interleave(case, arm, args.seconds, args.chunk_s, root / "runs", args.warmup_s)
            r["wall_s"] = round(time.perf_counter() - t0, 1)
            doc["cases"][name][arm] = r
            print(
                f"{name} {arm:>15}: ratio {r['ratio']:.4f} {r['ratio_ci95']}  median "
                f"{r['median_ratio']:.4f} {r['median_ratio_ci95']}  {r['cost_us_per_step']:+.1f} "
                f"us/step of {r['plain_step_ms']:.3f} ms",
                flush=True,
            )
            Path(args.out).write_text(json.dumps(doc, indent=2))  # survives a limit
    print(f"\n{gpu}: throughput ratio arm / plain, chunks alternating inside one loop")
    print(f"{'case':<8} {'arm':>15} {'ratio':>7} {'95% interval':>17} {'median':>7} {'us/step':>8}")
    for name, arms_out in doc["cases"].items():
        for arm, r in arms_out.items():
            lo, hi = r["ratio_ci95"]
            print(
                f"{name:<8} {arm:>15} {r['ratio']:7.4f} [{lo:.4f}, {hi:.4f}] "
                f"{r['median_ratio']:7.4f} {r['cost_us_per_step']:+8.1f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
