"""How long an hour-long run takes to open in the dashboard (issue 14: under 2 s).

Builds a synthetic record of one hour at 10 Hz (36,000 GPU and host samples) with 360,000
training steps (a 10 ms launch-bound step), then times, with the dashboard serving it on the
loopback: the server making the run page, and headless Chromium loading and drawing it
(``--dump-dom`` after plotly has drawn every figure; a fresh profile, so plotly.js is parsed
from scratch), less the browser's own start-up. Prints a short table; ``--out`` writes JSON.

    PYTHONPATH=src python benchmarks/ui_open_time.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from gpulens.probes.host import HOST_SCHEMA
from gpulens.probes.nvml.probe import GPU_SAMPLE_SCHEMA as GPU_SCHEMA
from gpulens.record.schema import STEPS_SCHEMA
from gpulens.record.writer import RunWriter

HOUR_S, HZ, STEP_S = 3600, 10, 0.01


def build_record(runs: Path) -> str:
    w = RunWriter(runs, kind="train", name="hour-long")
    t0 = time.time() - HOUR_S
    n = HOUR_S * HZ
    ts = [t0 + i / HZ for i in range(n)]
    wave = [50 + 45 * math.sin(i / 300) for i in range(n)]
    gpu = {"time_unix_s": ts, "gpu_index": [0] * n, "gpu_util_pct": wave,
           "sm_activity_pct": [v * 0.8 for v in wave],
           "tensor_activity_pct": [v * 0.3 for v in wave],
           "dram_bw_util_pct": [v * 0.5 for v in wave], "mem_used_bytes": [30 << 30] * n,
           "power_w": [200 + 4 * v for v in wave], "sm_clock_mhz": [1980] * n}  # fmt: skip
    host = {"time_unix_s": ts, "cpu_util_pct": wave}
    m = int(HOUR_S / STEP_S)
    steps = {"step": list(range(m)), "time_unix_s": [t0 + (i + 1) * STEP_S for i in range(m)],
             "warmup": [i < 20 for i in range(m)], "samples": [8] * m,
             "data_wait_s": [0.001] * m, "h2d_s": [0.0005] * m, "compute_s": [0.0085] * m,
             "step_time_s": [STEP_S] * m}  # fmt: skip
    series = w.dir / "series"
    series.mkdir(exist_ok=True)
    for name, cols, schema in (("gpu", gpu, GPU_SCHEMA), ("host", host, HOST_SCHEMA),
                               ("steps", steps, STEPS_SCHEMA)):  # fmt: skip
        rows = len(next(iter(cols.values())))
        table = pa.table(
            {f.name: pa.array(cols.get(f.name, [None] * rows), type=f.type) for f in schema}
        )
        pq.write_table(table, series / f"{name}.parquet")
    w.update(summary={"workload": "resnet18", "measured_steps": m - 20})
    w.finish("finished")
    return w.run_id


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="gpulens-ui-"))
    os.environ["GPULENS_HOME"] = str(home)
    run_id = build_record(home / "runs")
    from gpulens.web.server import make_server

    server, url = make_server(port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    page_url = f"{url}run/{run_id}"
    urllib.request.urlopen(url + "static/plotly.js").read()  # as a browser's cache would hold
    t = time.perf_counter()
    body = urllib.request.urlopen(page_url).read()
    server_s = time.perf_counter() - t
    result = {"gpu_samples": HOUR_S * HZ, "steps": int(HOUR_S / STEP_S), "page_bytes": len(body),
              "server_page_s": round(server_s, 3)}  # fmt: skip
    chromium = shutil.which("chromium")
    if chromium:
        # The browser's own start (a fresh profile, about:blank), to subtract.
        t = time.perf_counter()
        subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", f"--user-data-dir={home / 'blank'}",
             "--dump-dom", "about:blank"], capture_output=True, timeout=120,
        )  # fmt: skip
        result["browser_start_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        dom = subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", f"--user-data-dir={home / 'profile'}",
             "--dump-dom", page_url], capture_output=True, text=True, timeout=300,
        ).stdout  # fmt: skip
        result["browser_load_and_draw_s"] = round(time.perf_counter() - t, 3)
        result["figures_drawn"] = dom.count('class="plot-container plotly"')
        result["open_s_less_browser_start"] = round(
            result["browser_load_and_draw_s"] - result["browser_start_s"], 3
        )
    server.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    for k, v in result.items():
        print(f"{k:<26} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
