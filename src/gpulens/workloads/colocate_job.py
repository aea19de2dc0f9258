"""Jobs for ``gpulens colocate``: a built-in training or inference loop run for a fixed time.

One process runs one job (time-slice, MPS, MIG) or several jobs, each in its own thread on its
own CUDA stream (streams). The parent starts the processes, waits until every job has built its
model and warmed up (each process writes ``ready_file``), then writes ``go_file`` with a common
start time; every job measures from then for ``duration_s`` and the process writes one JSON
document to ``result_file``.

Step times are taken on the job's own stream only, so they hold when other work shares the GPU.
A closed-loop training job on a GPU queues its steps as a plain training loop does (at most
:data:`QUEUE_DEPTH` steps ahead of the GPU) and times them with CUDA events: a synchronize after
every step let the GPU run dry between steps and cost two resnet18 trainers under MPS about 5%
of a plain loop's throughput. Inference steps (and open-loop requests) are latencies, so each
is waited for.

    python -m gpulens.workloads.colocate_job SPEC.json

Jobs and their syntax: :mod:`gpulens.workloads.jobspec`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpulens.errors import UsageError
from gpulens.workloads.jobspec import JobSpec, ProcessSpec, percentile, wait_for_go, write_json
from gpulens.workloads.schedule import ScheduledLoop

log = logging.getLogger(__name__)

MIN_WARMUP_STEPS = 3
OOM_EXIT_CODE = 3
FAIL_EXIT_CODE = 4
QUEUE_DEPTH = 2  # steps a closed-loop trainer may queue ahead of the GPU


class _EventMarker:
    """A CUDA event recorded on a stream (a :class:`~gpulens.workloads.schedule.Marker`)."""

    def __init__(self, stream):
        import torch

        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record(stream)

    def wait(self) -> None:
        self.event.synchronize()

    def seconds_since(self, earlier: _EventMarker) -> float:
        return earlier.event.elapsed_time(self.event) / 1e3


class _Job:
    """One built-in job's model, data and step function, on its own stream."""

    def __init__(self, job: JobSpec, device, priority: int | None, seed: int):
        import torch

        from gpulens.workloads.models import get_workload

        self.job = job
        self.device = device
        self.cuda = device.type == "cuda"
        spec = get_workload(job.workload or "")
        self.spec = spec
        torch.manual_seed(seed)
        self.stream = None
        if self.cuda:
            self.stream = (
                torch.cuda.Stream(device=device, priority=priority)
                if priority is not None
                else torch.cuda.Stream(device=device)
            )
        batch = job.batch_size or spec.default_batch_size
        self.samples_per_step = batch
        g = torch.Generator().manual_seed(seed)
        with self._on_stream():
            model = spec.build().to(device)
            image = spec.task == "image_classification" and self.cuda
            if image:
                model = model.to(memory_format=torch.channels_last)
            if spec.is_language_model:
                tokens = torch.randint(0, spec.vocab_size, (batch, spec.input_shape[0] + 1),
                                       generator=g)  # fmt: skip
                self.x, self.y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
            else:
                x = torch.randn((batch, *spec.input_shape), generator=g).to(device)
                self.x = x.contiguous(memory_format=torch.channels_last) if image else x
                self.y = torch.randint(0, spec.num_classes, (batch,), generator=g).to(device)
        self.model = model
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(job.precision)
        self.autocast = (
            (lambda: torch.autocast(device_type=device.type, dtype=dtype))
            if dtype is not None
            else None
        )
        if job.kind == "train":
            model.train()
            # the optimizer rule of `gpulens run` (ViT gets AdamW in both now)
            from gpulens.workloads.recipe import optimizer_for

            self.opt = optimizer_for(spec, model)
            self.scaler = torch.amp.GradScaler(device.type) if job.precision == "fp16" else None
        else:
            model.eval()
        # Closed loop, or the requests' arrivals: step times are latencies from the arrival.
        self.loop = ScheduledLoop(job.schedule(seed))
        self.step_times_s = self.loop.step_times_s
        self.samples = 0
        self.error: str | None = None
        self.error_kind: str | None = None
        self.peak_mem_bytes: int | None = None

    def _on_stream(self):
        import contextlib

        import torch

        return torch.cuda.stream(self.stream) if self.stream is not None else \
            contextlib.nullcontext()  # fmt: skip

    def step(self) -> None:
        """One step, waited for on the job's stream."""
        self.queue_step()
        if self.stream is not None:
            self.stream.synchronize()

    def queue_step(self) -> None:
        """One step's work, queued on the job's stream (not waited for)."""
        import contextlib

        import torch

        ctx = self.autocast() if self.autocast else contextlib.nullcontext()
        if self.job.kind == "infer":
            with torch.inference_mode(), ctx:
                self.model(self.x)
        else:
            with ctx:
                loss = self.spec.loss(self.model(self.x), self.y)
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                loss.backward()
                self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def run(self, warmup_s: float, ready: threading.Event, go: threading.Event,
            deadline: list[float]) -> None:  # fmt: skip
        import torch

        try:
            if self.cuda:
                torch.cuda.set_device(self.device)
            with self._on_stream():
                t0 = time.perf_counter()
                n = 0
                while n < MIN_WARMUP_STEPS or time.perf_counter() - t0 < warmup_s:
                    self.step()
                    n += 1
                ready.set()
                go.wait()
                self._measure(deadline[0])
        except torch.cuda.OutOfMemoryError as exc:
            self.error_kind, self.error = "oom", f"CUDA out of memory: {str(exc)[:200]}"
        except Exception as exc:
            self.error_kind, self.error = "failed", f"{type(exc).__name__}: {exc}"[:500]
        finally:
            ready.set()

    def _measure(self, end_unix_s: float) -> None:
        queued = self.job.kind == "train" and not self.loop.schedule.open_loop
        if self.stream is not None and queued:
            steps = self.loop.run_queued(
                self.queue_step, lambda: _EventMarker(self.stream), end_unix_s, QUEUE_DEPTH
            )
            self.samples += steps * self.samples_per_step
        else:
            self.loop.run(self._counted_step, end_unix_s)

    def _counted_step(self) -> None:
        self.step()
        self.samples += self.samples_per_step

    def _throughput_ci95_pct(self) -> float | None:
        """Batch-means 95% CI of the throughput; None for inference at a fixed request rate,
        whose throughput is the rate and whose step times are latencies."""
        from gpulens.stats import throughput_ci

        if self.job.rate_per_s is not None or len(self.step_times_s) < 20:
            return None
        ci = throughput_ci(self.step_times_s, self.samples_per_step)
        return ci.ci95_pct if ci is not None and math.isfinite(ci.ci95_pct) else None

    def result(self) -> dict[str, Any]:
        times = self.step_times_s
        window_s = self.loop.window_s if self.loop.start_unix_s is not None else None
        return {
            "name": self.job.name,
            "key": self.job.key,
            "kind": self.job.kind,
            "steps": len(times),
            "samples": self.samples,
            "window_s": window_s,
            "throughput_samples_per_s": self.samples / window_s if window_s and times else None,
            "throughput_ci95_pct": self._throughput_ci95_pct(),
            "step_time_mean_s": sum(times) / len(times) if times else None,
            "step_time_p50_s": percentile(times, 50),
            "step_time_p99_s": percentile(times, 99),
            "step_times_s": [round(t, 6) for t in times],
            "peak_mem_bytes": self.peak_mem_bytes,
            "error": self.error,
            "error_kind": self.error_kind,
        }


def run_process(spec: ProcessSpec) -> int:
    """Build, warm up, wait for go, measure, write the result. Returns the exit code."""
    if spec.jobs and spec.jobs[0].get("kind") == "serve":
        from gpulens.workloads.colocate_serve import run_serve_process

        return run_serve_process(spec)
    import torch

    parent_pid = os.getppid()
    doc: dict[str, Any] = {"pid": os.getpid(), "jobs": [], "error": None, "error_kind": None}
    jobs: list[_Job] = []
    try:
        if spec.cpu_threads:
            torch.set_num_threads(spec.cpu_threads)
        from gpulens.workloads.devices import resolve_device

        device = resolve_device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            props = torch.cuda.get_device_properties(device)
            doc["device_name"] = props.name
            doc["device_uuid"] = str(getattr(props, "uuid", "")) or None
            doc["device_total_mem_bytes"] = int(props.total_memory)
        prios = spec.stream_priorities or [None] * len(spec.jobs)
        for i, (d, prio) in enumerate(zip(spec.jobs, prios, strict=True)):
            jobs.append(_Job(JobSpec.from_dict(d), device, prio, spec.seed + i))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except torch.cuda.OutOfMemoryError as exc:
        doc.update(error=f"CUDA out of memory while building: {str(exc)[:200]}", error_kind="oom")
        write_json(spec.result_file, doc)
        return OOM_EXIT_CODE
    except Exception as exc:
        doc.update(error=f"{type(exc).__name__}: {exc}"[:500], error_kind="failed")
        write_json(spec.result_file, doc)
        return FAIL_EXIT_CODE

    readies = [threading.Event() for _ in jobs]
    go = threading.Event()
    deadline = [0.0]
    threads = [
        threading.Thread(
            target=j.run,
            args=(spec.warmup_s, r, go, deadline),
            daemon=True,
            name=f"job-{j.job.name}",
        )  # fmt: skip
        for j, r in zip(jobs, readies, strict=True)
    ]
    for t in threads:
        t.start()
    for r in readies:
        r.wait()
    early = [j for j in jobs if j.error]
    Path(spec.ready_file).write_text(json.dumps({"errors": [j.error for j in early]}))
    if not early:
        start = wait_for_go(spec.go_file, parent_pid)
        deadline[0] = start + spec.duration_s
    else:
        deadline[0] = 0.0
    go.set()
    for t in threads:
        t.join()
    cuda = jobs and jobs[0].cuda
    process_peak = int(torch.cuda.max_memory_reserved()) if cuda else None
    if len(jobs) == 1 and cuda:
        jobs[0].peak_mem_bytes = process_peak
    doc["process_peak_mem_bytes"] = process_peak
    doc["jobs"] = [j.result() for j in jobs]
    kinds = {j.error_kind for j in jobs if j.error_kind}
    if kinds:
        doc["error_kind"] = "oom" if "oom" in kinds else "failed"
        doc["error"] = "; ".join(f"{j.job.name}: {j.error}" for j in jobs if j.error)
    write_json(spec.result_file, doc)
    return OOM_EXIT_CODE if doc["error_kind"] == "oom" else FAIL_EXIT_CODE if kinds else 0


def probe_device(device: str | None) -> dict[str, Any]:
    """What ``device`` is (name, UUID, memory), as the jobs will see it."""
    import torch

    from gpulens.probes.nvml.inventory import nvml_uuid
    from gpulens.workloads.devices import resolve_device

    dev = resolve_device(device)
    if dev.type != "cuda":
        return {"device": "cpu"}
    props = torch.cuda.get_device_properties(dev)
    return {
        "device": str(dev),
        "name": props.name,
        "uuid": nvml_uuid(getattr(props, "uuid", None)),
        "memory_total_bytes": int(props.total_memory),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--probe":
        try:
            print(json.dumps(probe_device(None if args[1] == "auto" else args[1])))
        except UsageError as exc:
            print(json.dumps({"error": str(exc)}))
        return 0
    if len(args) != 1:
        print("usage: python -m gpulens.workloads.colocate_job SPEC.json", file=sys.stderr)
        return 2
    spec = ProcessSpec(**json.loads(Path(args[0]).read_text()))
    return run_process(spec)


if __name__ == "__main__":
    sys.exit(main())
