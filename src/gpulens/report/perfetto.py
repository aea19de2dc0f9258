"""A run as a Chrome/Perfetto trace (the JSON "trace event" format): steps and their phases,
loader-worker stages, and GPU and host counters on one time line. Opens in ui.perfetto.dev and
chrome://tracing.

Times are microseconds from the run's first event (``metadata.t0_unix_s`` holds it). Every
series row is stamped when it ended, so a step spans ``[end - step_time_s, end]`` with its
phases laid end to end inside it (data wait, copy, compute as the host saw them), and a loader
sample's read, decode and augment likewise end at its stamp.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pandas as pd

from gpulens.record.reader import RunRecord, rank_ids, read_prep

PID_STEPS, PID_LOADER, PID_GPU, PID_HOST = 1, 2, 3, 4
GPU_COUNTERS = {
    "activity %": ("gpu_util_pct", "sm_activity_pct", "tensor_activity_pct", "dram_bw_util_pct"),
    "memory GiB": ("mem_used_bytes",),
    "power W": ("power_w",),
    "clocks MHz": ("sm_clock_mhz", "mem_clock_mhz"),
    "PCIe MB/s": ("pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s"),
}
HOST_COUNTERS = {
    "CPU %": ("cpu_util_pct", "proc_tree_cpu_pct"),
    "disk read MB/s": ("disk_read_bytes_per_s",),
}
SCALE = {"mem_used_bytes": 2**-30, "pcie_tx_bytes_per_s": 1e-6, "pcie_rx_bytes_per_s": 1e-6,
         "disk_read_bytes_per_s": 1e-6}  # fmt: skip
STAGES = ("read_s", "decode_s", "augment_s")


def _num(value: Any) -> float | None:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _meta(pid: int, name: str, tid: int | None = None, thread: str | None = None) -> dict:
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": thread}}


def _slice(name: str, cat: str, pid: int, tid: int, start_us: float, dur_us: float, **args):
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid,
            "ts": round(start_us, 3), "dur": round(max(dur_us, 0.0), 3), "args": args}  # fmt: skip


def _series(record: RunRecord, name: str) -> pd.DataFrame:
    return record.series(name) if name in record.series_names() else pd.DataFrame()


def _t0(frames: list[pd.DataFrame], steps: pd.DataFrame) -> float | None:
    starts = [float(f["time_unix_s"].min()) for f in frames if not f.empty]
    if not steps.empty:
        starts.append(float((steps["time_unix_s"] - steps["step_time_s"].fillna(0)).min()))
    return min(starts) if starts else None


def step_events(steps: pd.DataFrame, t0: float) -> list[dict]:
    """One slice per step (warm-up steps marked), its phases nested inside it; a run that
    keeps every rank's steps has a track per rank (``rank R steps``)."""
    events = [_meta(PID_STEPS, "training loop")]
    ranks = rank_ids(steps)
    if len(ranks) < 2:
        return events + _track_events(steps, t0, 1, "steps")
    for rank in ranks:
        events += _track_events(steps[steps["rank"] == rank], t0, 1 + rank, f"rank {rank} steps")
    return events


def _track_events(steps: pd.DataFrame, t0: float, tid: int, name: str) -> list[dict]:
    events = [_meta(PID_STEPS, "", tid, name)]
    for row in steps.itertuples(index=False):
        step_s = _num(row.step_time_s)
        if step_s is None:
            continue
        end_us = (row.time_unix_s - t0) * 1e6
        start_us = end_us - step_s * 1e6
        warm = bool(getattr(row, "warmup", False))
        cat = "warmup" if warm else "step"
        events.append(
            _slice(f"step {row.step}", cat, PID_STEPS, tid, start_us, step_s * 1e6,
                   samples=int(row.samples), warmup=warm)
        )  # fmt: skip
        t = start_us
        for phase in ("data_wait", "h2d", "compute"):
            dur_s = _num(getattr(row, f"{phase}_s"))
            if dur_s is None:
                continue
            dur_us = min(dur_s * 1e6, end_us - t)  # the phases never outrun their step
            events.append(_slice(phase.replace("_", " "), "phase", PID_STEPS, tid, t, dur_us))
            t += dur_us
    return events


def loader_events(prep: pd.DataFrame, t0: float) -> list[dict]:
    """Each loader worker on a track of its own: every sample's read, decode and augment, every
    batch's collate."""
    if prep.empty:
        return []
    events = [_meta(PID_LOADER, "data-loader workers")]
    for worker in sorted(prep["worker_id"].dropna().unique()):
        events.append(_meta(PID_LOADER, "", int(worker) + 1, f"worker {int(worker)}"))
    for row in prep.itertuples(index=False):
        if _num(row.worker_id) is None:
            continue
        tid = int(row.worker_id) + 1
        end_us = (row.time_unix_s - t0) * 1e6
        collate_s = _num(getattr(row, "collate_s", None))
        if collate_s is not None:
            events.append(_slice("collate", "loader", PID_LOADER, tid, end_us - collate_s * 1e6,
                                 collate_s * 1e6))  # fmt: skip
            continue
        durs = [(stage, _num(getattr(row, stage, None))) for stage in STAGES]
        durs = [(stage, d) for stage, d in durs if d is not None]
        t = end_us - sum(d for _, d in durs) * 1e6
        for stage, d in durs:
            events.append(_slice(stage.removesuffix("_s"), "loader", PID_LOADER, tid, t, d * 1e6))
            t += d * 1e6
    return events


def counter_events(
    df: pd.DataFrame, t0: float, pid: int, title: str, groups: dict[str, tuple[str, ...]]
) -> list[dict]:
    """Counter tracks (one per group, a line per column) from a sampled series."""
    if df.empty:
        return []
    events = [_meta(pid, title)]
    for row in df.to_dict("records"):
        ts = round((row["time_unix_s"] - t0) * 1e6, 3)
        for name, columns in groups.items():
            args = {}
            for col in columns:
                v = _num(row.get(col))
                if v is not None:
                    args[col] = v * SCALE.get(col, 1.0)
            if args:
                events.append({"ph": "C", "name": name, "pid": pid, "ts": ts, "args": args})
    return events


TORCH_PID_OFFSET = 1000  # the profiler's process and device ids, moved clear of ours
TORCH_TRACE_FILE = "torch_trace.json"  # as gpulens.workloads.profile writes it
ALIGN_MARKER = "gpulens:align"


def torch_events(trace: dict[str, Any], t0: float, align_unix_s: float | None) -> tuple[list, str]:
    """A PyTorch profiler (Kineto) Chrome trace's events on the run's time line, and how they
    were aligned: by the ``gpulens:align`` marker entered at ``align_unix_s`` (exact), else by
    the profiler's ``baseTimeNanoseconds`` (its own clock, which can be seconds off)."""
    events = [e for e in trace.get("traceEvents") or [] if isinstance(e, dict)]
    base_us = float(trace.get("baseTimeNanoseconds") or 0) / 1000.0
    marker = next((e for e in events if e.get("name") == ALIGN_MARKER and "ts" in e), None)
    if marker is not None and align_unix_s is not None:
        shift_us, how = (align_unix_s - t0) * 1e6 - float(marker["ts"]), "marker"
    else:
        shift_us, how = base_us - t0 * 1e6, "profiler clock"
    out = []
    for event in events:
        if event.get("name") == ALIGN_MARKER:
            continue
        moved = dict(event)
        if isinstance(moved.get("pid"), int):
            moved["pid"] += TORCH_PID_OFFSET
        if "ts" in moved and _num(moved["ts"]) is not None:
            moved["ts"] = round(float(moved["ts"]) + shift_us, 3)
        if moved.get("ph") == "M" and moved.get("name") == "process_name":
            args = dict(moved.get("args") or {})
            args["name"] = f"torch.profiler: {args.get('name', '')}".strip()
            moved["args"] = args
        out.append(moved)
    return out, how


def perfetto_trace(record: RunRecord, torch_trace: dict[str, Any] | None = None) -> dict[str, Any]:
    """The trace document of one run (``traceEvents`` plus metadata). A PyTorch profiler trace
    (``torch_trace``, else the record's own from ``--torch-profiler``) is merged in."""
    steps, gpu, host = _series(record, "steps"), _series(record, "gpu"), _series(record, "host")
    prep = read_prep(record.dir)
    t0 = _t0([gpu, host, prep], steps)
    events: list[dict] = []
    if t0 is not None:
        if not steps.empty:
            events += step_events(steps, t0)
        events += loader_events(prep, t0)
        if not gpu.empty:
            for index, per_gpu in gpu.groupby("gpu_index"):
                events += counter_events(per_gpu, t0, PID_GPU + 10 * int(index),
                                         f"GPU {int(index)}", GPU_COUNTERS)  # fmt: skip
        events += counter_events(host, t0, PID_HOST, "host", HOST_COUNTERS)
    profiled = record.meta.get("torch_profiler") or {}
    if torch_trace is None and (record.dir / TORCH_TRACE_FILE).is_file():
        torch_trace = json.loads((record.dir / TORCH_TRACE_FILE).read_text())
    aligned = None
    if torch_trace is not None:
        if t0 is None:
            t0 = float(torch_trace.get("baseTimeNanoseconds") or 0) / 1e9
        merged, aligned = torch_events(torch_trace, t0, profiled.get("align_unix_s"))
        events += merged
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "distributedInfo": {"rank": 0},  # what Holistic Trace Analysis's parser looks for
        "metadata": {
            "gpulens_run_id": record.run_id,
            "name": record.meta.get("name"),
            "kind": record.meta.get("kind"),
            "status": record.status,
            "t0_unix_s": t0,
            "torch_profiler_aligned_by": aligned,
        },
    }
