"""`gpulens run --prometheus-port`: dcgm-exporter's names and units on samples recorded on a
real H100, the step metrics from its step series, and a live endpoint on a CPU run."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gpulens.errors import UsageError
from gpulens.record.reader import read_record
from gpulens.web.metrics import LiveMetrics, MetricsEndpoint, serve, step_window

FIXTURE = Path(__file__).parent / "fixtures" / "record_h100_resnet50_jpeg"
# name{labels} value, as Prometheus's text format 0.0.4 has it
SAMPLE_LINE = re.compile(
    r'^([a-zA-Z_:][\w:]*)(?:\{((?:[a-zA-Z_]\w*="(?:\\.|[^"\\])*",?)*)\})? (\S+)$'
)


def parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of an exposition, checking each line's syntax on the way."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) \S+ .+$", line), line
            continue
        match = SAMPLE_LINE.match(line)
        assert match, line
        name, labels_text, value = match.groups()
        labels = dict(re.findall(r'(\w+)="((?:\\.|[^"\\])*)"', labels_text or ""))
        out.setdefault(name, []).append((labels, float(value)))
    return out


def test_gpu_samples_keep_dcgm_exporters_names_units_and_labels(tmp_path):
    record = read_record(FIXTURE)
    gpu_row = record.series("gpu").iloc[80].to_dict()
    live = LiveMetrics(FIXTURE)
    live.observe("gpu", gpu_row)
    live.observe("host", record.series("host").iloc[5].to_dict())
    metrics = parse(live.text(now_s=gpu_row["time_unix_s"]))

    (labels, fb_mib), = metrics["DCGM_FI_DEV_FB_USED"]  # fmt: skip
    assert fb_mib == pytest.approx(gpu_row["mem_used_bytes"] / 2**20)
    gpu = record.meta["environment"]["gpus"][0]
    assert labels["gpu"] == "0" and labels["UUID"] == gpu["uuid"]
    assert labels["modelName"] == "NVIDIA H100 80GB HBM3" and labels["device"] == "nvidia0"
    assert labels["gpulens_run_id"] == record.run_id
    # DCGM's profiling fields are ratios, its utilization fields percentages
    assert metrics["DCGM_FI_PROF_SM_ACTIVE"][0][1] == pytest.approx(
        gpu_row["sm_activity_pct"] / 100
    )
    assert metrics["DCGM_FI_DEV_GPU_UTIL"][0][1] == gpu_row["gpu_util_pct"]
    assert metrics["DCGM_FI_DEV_POWER_USAGE"][0][1] == pytest.approx(gpu_row["power_w"], rel=1e-5)
    assert "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION" not in metrics  # ours is since the run began
    assert metrics["gpulens_gpu_energy_joules_total"][0][1] == pytest.approx(
        gpu_row["energy_j"], rel=1e-5
    )
    assert metrics["gpulens_host_cpu_util_percent"][0][1] > 90


def test_a_sparse_column_keeps_its_last_value():
    live = LiveMetrics(FIXTURE)
    live.observe("gpu", {"gpu_index": 0, "power_w": 300.0, "energy_j": 12.0})
    live.observe("gpu", {"gpu_index": 0, "power_w": 310.0, "energy_j": None})
    metrics = parse(live.text(now_s=0))
    assert metrics["DCGM_FI_DEV_POWER_USAGE"][0][1] == 310.0
    assert metrics["gpulens_gpu_energy_joules_total"][0][1] == 12.0


def test_step_metrics_agree_with_the_recorded_run():
    record = read_record(FIXTURE)
    steps = record.series("steps")
    end_s = float(steps["time_unix_s"].max())
    whole = step_window(steps, now_s=end_s, window_s=1e9)
    measured = steps[~steps["warmup"]]
    assert whole["steps_total"] == len(measured) == record.meta["summary"]["measured_steps"]
    assert whole["samples_total"] == measured["samples"].sum()
    # over the whole run the live throughput is the summary's, within the first step's share
    assert whole["throughput_samples_per_second"] == pytest.approx(
        record.meta["summary"]["throughput_samples_per_s"], rel=0.02
    )
    recent = step_window(steps, now_s=end_s, window_s=2.0)
    assert 0 <= recent["data_wait_ratio"] <= 1
    assert recent["step_time_seconds"] == pytest.approx(
        measured[measured["time_unix_s"] >= end_s - 2.0]["step_time_s"].mean()
    )
    assert step_window(None, now_s=end_s) == {}


def test_serve_answers_metrics_only_and_reports_a_taken_port():
    server, url = serve(MetricsEndpoint(0), lambda: "gpulens_up 1\n")
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert resp.read() == b"gpulens_up 1\n"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url.replace("/metrics", "/../run.json"), timeout=5)
        assert err.value.code == 404
        port = server.server_address[1]
        with pytest.raises(UsageError, match="pick another --prometheus-port"):
            MetricsEndpoint(port).check_free()
        with pytest.raises(UsageError, match="pick another --prometheus-port"):
            serve(MetricsEndpoint(port), lambda: "")
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(UsageError, match="0..65535"):
        MetricsEndpoint(70000)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_a_live_cpu_run_is_scraped_while_it_trains(tmp_path):
    home = tmp_path / "home"
    port = _free_port()
    env = {**os.environ, "GPULENS_HOME": str(home)}
    # --duration counts from the end of the warm-up, as the measured steps the scrapes wait
    # for do: both scrapes came within 3.5 s of it on a 2-core machine, so 7 s leaves them
    # room (12 s left 8 s of a run that nobody scraped)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpulens.cli", "run", "tiny_cnn", "--device", "cpu",
         "--duration", "7", "--no-store", "--json", "--prometheus-port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/metrics"
    seen: list[float] = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(seen) < 2 and proc.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    metrics = parse(resp.read().decode())
                steps = metrics.get("gpulens_steps_total", [({}, 0.0)])[0][1]
                if steps > 0:  # past the warm-up, on a busy machine too
                    seen.append(steps)
                    time.sleep(2.5)
                    continue
            except OSError:
                pass
            time.sleep(0.3)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-1500:]
    assert len(seen) == 2 and seen[1] > seen[0] > 0, (seen, err[-1500:])
    doc = json.loads(out)
    meta = json.loads((Path(doc["record_dir"]) / "run.json").read_text())
    assert meta["metrics_url"] == url
    with pytest.raises(OSError):  # gone with the run
        urllib.request.urlopen(url, timeout=2)
    shutil.rmtree(home)
