"""Host-side summary of torch profiler traces (what slim_records.py drops): per trace, the
profiled steps' wall time, the CUDA runtime calls (launches, synchronisations) and the kernels'
busy time, so that a host-bound step can be told from a GPU-bound one after slimming.

    python benchmarks/trace_host_summary.py RUNS_DIR > host_summary.json
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path


def summarize(trace: Path) -> dict:
    events = json.loads(trace.read_bytes())["traceEvents"]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    runtime = Counter()
    runtime_us = Counter()
    for e in events:
        if e.get("cat") == "cuda_runtime" and e.get("dur") is not None:
            runtime[e["name"]] += 1
            runtime_us[e["name"]] += float(e["dur"])
    kernel_us = sum(float(e["dur"]) for e in events if e.get("cat") == "kernel" and e.get("dur"))
    n = max(len(steps), 1)
    return {
        "profiled_steps": len(steps),
        "step_wall_us": [float(e["dur"]) for e in steps],
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
            **summarize(trace),
        }
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
