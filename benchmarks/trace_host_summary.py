"""Host-side summary of torch profiler traces: per trace and per profiled step, the span of the
CUDA runtime calls, the most frequent runtime calls with their time, and the kernels' busy time.
Under the profiler the host runs slower than in the run (1.3-2.5x on an H100, session 15), so
the span is the profiled window's, not the run's own pace.

    python benchmarks/trace_host_summary.py RUNS_DIR > host_summary.json
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path


def summarize(trace: Path, profiled_steps: int) -> dict:
    events = json.loads(trace.read_bytes())["traceEvents"]
    runtime = Counter()
    runtime_us = Counter()
    for e in events:
        if e.get("cat") == "cuda_runtime" and e.get("dur") is not None:
            runtime[e["name"]] += 1
            runtime_us[e["name"]] += float(e["dur"])
    kernel_us = sum(float(e["dur"]) for e in events if e.get("cat") == "kernel" and e.get("dur"))
    n = max(profiled_steps, 1)
    runtime_ts = [float(e["ts"]) for e in events if e.get("cat") == "cuda_runtime" and "ts" in e]
    return {
        "profiled_steps": profiled_steps,
        # the window's host side, first to last runtime call (all threads), per step: under
        # the profiler, not the run's own pace
        "runtime_span_us_per_step": (max(runtime_ts) - min(runtime_ts)) / n if runtime_ts else None,
        "kernel_busy_us_per_step": kernel_us / n,
        "runtime_calls_per_step": {k: v / n for k, v in runtime.most_common(8)},
        "runtime_us_per_step": {k: runtime_us[k] / n for k, _ in runtime.most_common(8)},
    }


def main(root: str) -> None:
    out = {}
    for run_json in sorted(Path(root).glob("**/run.json")):
        meta = json.loads(run_json.read_text())
        trace = run_json.parent / "torch_trace.json"
        if not trace.is_file():
            continue
        s = meta.get("summary") or {}
        out[meta.get("name") or run_json.parent.name] = {
            "run_id": meta.get("run_id"),
            "batch_size": s.get("batch_size"),
            "step_s": (s.get("phases_s") or {}).get("step"),
            **summarize(trace, int((meta.get("torch_profiler") or {}).get("steps") or 0)),
        }
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
