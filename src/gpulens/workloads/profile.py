"""PyTorch profiler steps after the measured window (``gpulens run WORKLOAD --torch-profiler N``).

The profiler slows the steps it watches, so it never watches measured ones: once the measured
window has ended, ``N`` more steps run under ``torch.profiler`` (CPU ops, and CUDA kernels on a
GPU, with input shapes) and its Chrome trace is saved in the record as
``torch_trace.json``. A marker (``gpulens:align``, a ``record_function`` entered at a known
wall-clock time) lets ``gpulens export --perfetto`` lay the kernels on the run's own time line,
to the microsecond; the profiler's own clock can be seconds off the wall clock.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from gpulens.workloads.recipe import Prepared

TRACE_FILE = "torch_trace.json"
ALIGN_MARKER = "gpulens:align"


def profile_steps(prepared: Prepared, device: torch.device, n_steps: int, run_dir: Path) -> dict:
    """Run ``n_steps`` more training steps under the profiler; returns what run.json keeps
    (``torch_profiler``): steps, file, and the marker's wall-clock time. Stops early when the
    data runs out."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    done = 0
    # Input shapes give each kernel its FLOPs and bytes (`gpulens predict`, arithmetic intensity).
    with profile(activities=activities, record_shapes=True) as prof:
        align_unix_s = time.time()
        with record_function(ALIGN_MARKER):
            pass
        for _ in range(n_steps):
            try:
                x, y = next(prepared.batches)
            except StopIteration:
                break
            if x.device != device:
                x = x.to(device, non_blocking=True, memory_format=prepared.memory_format)
                y = y.to(device, non_blocking=True)
            with record_function(f"gpulens step {done}"):
                prepared.step_fn(x, y)
            done += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    prof.export_chrome_trace(str(Path(run_dir) / TRACE_FILE))
    out: dict[str, Any] = {"steps": done, "file": TRACE_FILE, "after_measured_steps": True}
    out.update(align_marker=ALIGN_MARKER, align_unix_s=align_unix_s)
    return out
