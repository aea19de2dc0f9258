"""A Prometheus ``/metrics`` endpoint for a live run (``gpulens run --prometheus-port``).

Served from the sampler process (never the training loop's), from the latest sample of each
probe and the run's step series. GPU quantities that dcgm-exporter also exports carry its names,
units and labels (``gpu``, ``UUID``, ``device``, ``modelName``, ``Hostname``), so a Grafana
dashboard made for dcgm-exporter shows a gpulens run; what only gpulens knows (step time, data
wait share, throughput) is named ``gpulens_*``. Standard library only: the measuring side stays
lean. The text format is Prometheus's exposition format 0.0.4.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from gpulens.errors import UsageError

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STEP_WINDOW_S = 30.0  # step metrics over the steps that ended in the last this-many seconds
MIB = 1024 * 1024

# (gpulens column, dcgm-exporter name, type, help, scale to dcgm's unit)
DCGM_GAUGES: tuple[tuple[str, str, str, float], ...] = (
    ("gpu_util_pct", "DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", 1.0),
    ("mem_util_pct", "DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", 1.0),
    ("sm_clock_mhz", "DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", 1.0),
    ("mem_clock_mhz", "DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", 1.0),
    ("temperature_c", "DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", 1.0),
    ("power_w", "DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", 1.0),
    ("mem_used_bytes", "DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", 1 / MIB),
    ("sm_activity_pct", "DCGM_FI_PROF_SM_ACTIVE", "Ratio of cycles an SM has at least 1 warp "
     "assigned.", 0.01),
    ("sm_occupancy_pct", "DCGM_FI_PROF_SM_OCCUPANCY", "Ratio of resident warps per SM.", 0.01),
    ("tensor_activity_pct", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "Ratio of cycles the tensor "
     "pipe is active.", 0.01),
    ("dram_bw_util_pct", "DCGM_FI_PROF_DRAM_ACTIVE", "Ratio of cycles the device memory "
     "interface is active.", 0.01),
    ("pcie_tx_bytes_per_s", "DCGM_FI_PROF_PCIE_TX_BYTES", "PCIe transmitted bytes per second.",
     1.0),
    ("pcie_rx_bytes_per_s", "DCGM_FI_PROF_PCIE_RX_BYTES", "PCIe received bytes per second.",
     1.0),
)  # fmt: skip
HOST_GAUGES: tuple[tuple[str, str, str, float], ...] = (
    ("cpu_util_pct", "gpulens_host_cpu_util_percent", "Host CPU utilization (in %).", 1.0),
    ("proc_tree_cpu_pct", "gpulens_process_tree_cpu_percent",
     "CPU of the run's processes (in % of one core).", 1.0),
    ("mem_used_bytes", "gpulens_host_memory_used_bytes", "Host memory used.", 1.0),
    ("disk_read_bytes_per_s", "gpulens_host_disk_read_bytes_per_second", "Disk reads.", 1.0),
    ("net_rx_bytes_per_s", "gpulens_host_network_receive_bytes_per_second", "Network in.", 1.0),
)  # fmt: skip


@dataclass(frozen=True)
class MetricsEndpoint:
    """Where to serve ``/metrics``: ``port`` 0 takes any free port. Loopback by default."""

    port: int
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise UsageError(f"--prometheus-port must be in 0..65535, got {self.port}")
        if not self.host:
            raise UsageError("--prometheus-host must not be empty (default 127.0.0.1)")

    def check_free(self) -> None:
        """Fail now, before a run record exists, when the address cannot be bound (the
        sampler binds it again once the run starts)."""
        if self.port == 0:
            return
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((self.host, self.port))
            except OSError as exc:
                raise UsageError(_bind_error(self, exc)) from None

    def as_arg(self) -> str:
        return f"{self.host}|{self.port}"

    @classmethod
    def from_arg(cls, text: str) -> MetricsEndpoint:
        host, port = text.rsplit("|", 1)
        return cls(int(port), host)


def _bind_error(endpoint: MetricsEndpoint, exc: OSError) -> str:
    return (
        f"cannot serve Prometheus metrics on {endpoint.host}:{endpoint.port} "
        f"({exc.strerror or exc}): pick another --prometheus-port"
    )


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, Any]) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items() if v is not None)
    return "{" + inner + "}" if inner else ""


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def step_window(steps: Any, now_s: float, window_s: float = STEP_WINDOW_S) -> dict[str, float]:
    """Counters over all measured steps and means over the last ``window_s`` seconds, from a
    steps table (pandas DataFrame with the step series' columns)."""
    if steps is None or len(steps) == 0:
        return {}
    measured = steps[~steps["warmup"].astype(bool)] if "warmup" in steps else steps
    out = {
        "steps_total": float(len(measured)),
        "samples_total": float(measured["samples"].fillna(0).sum()),
    }
    recent = measured[measured["time_unix_s"] >= now_s - window_s]
    if len(recent) >= 2:
        span_s = float(recent["time_unix_s"].iloc[-1] - recent["time_unix_s"].iloc[0])
        step_s = float(recent["step_time_s"].sum())
        if span_s > 0:
            # samples of the steps after the first, over the time between the first and last
            out["throughput_samples_per_second"] = float(recent["samples"].iloc[1:].sum()) / span_s
        out["step_time_seconds"] = float(recent["step_time_s"].mean())
        if step_s > 0:
            out["data_wait_ratio"] = float(recent["data_wait_s"].fillna(0).sum()) / step_s
    return out


def render(
    gpu_rows: Mapping[int, Mapping[str, Any]],
    host_row: Mapping[str, Any] | None,
    steps: Mapping[str, float],
    gpu_labels: Mapping[int, Mapping[str, Any]],
    run_labels: Mapping[str, Any],
) -> str:
    """The exposition text: dcgm-exporter's names for the GPU, ``gpulens_*`` for the rest."""
    lines: list[str] = []
    run = _labels(run_labels)
    for column, name, help_text, scale in DCGM_GAUGES:
        samples = [
            (idx, _number(row.get(column))) for idx, row in sorted(gpu_rows.items())
        ]  # fmt: skip
        samples = [(idx, v) for idx, v in samples if v is not None]
        if not samples:
            continue
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for idx, value in samples:
            labels = {**gpu_labels.get(idx, {"gpu": idx}), **run_labels}
            lines.append(f"{name}{_labels(labels)} {value * scale:g}")
    energy = [(i, _number(r.get("energy_j"))) for i, r in sorted(gpu_rows.items())]
    energy = [(i, v) for i, v in energy if v is not None]
    if energy:
        # since the run's monitor started (dcgm-exporter's counter counts since boot, in mJ)
        name = "gpulens_gpu_energy_joules_total"
        lines += [f"# HELP {name} GPU energy since the run started.", f"# TYPE {name} counter"]
        for idx, value in energy:
            labels = {**gpu_labels.get(idx, {"gpu": idx}), **run_labels}
            lines.append(f"{name}{_labels(labels)} {value:g}")
    for column, name, help_text, scale in HOST_GAUGES:
        value = _number((host_row or {}).get(column))
        if value is not None:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
            lines.append(f"{name}{run} {value * scale:g}")
    for key, kind, help_text in (
        ("steps_total", "counter", "Measured training steps."),
        ("samples_total", "counter", "Samples in the measured steps."),
        ("throughput_samples_per_second", "gauge", f"Samples/s over the last {STEP_WINDOW_S:g} s."),
        ("step_time_seconds", "gauge", f"Mean step time over the last {STEP_WINDOW_S:g} s."),
        ("data_wait_ratio", "gauge", "Share of step time spent waiting for data (0-1)."),
    ):  # fmt: skip
        if key in steps:
            name = f"gpulens_{key}"
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines.append(f"{name}{run} {steps[key]:g}")
    lines += ["# HELP gpulens_up 1 while the run is being measured.", "# TYPE gpulens_up gauge"]
    lines.append(f"gpulens_up{run} 1")
    return "\n".join(lines) + "\n"


def record_labels(run_dir: Path) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """The run's labels and each GPU's dcgm-exporter labels, from the record's ``run.json``."""
    try:
        meta = json.loads((Path(run_dir) / "run.json").read_text())
    except (OSError, ValueError):
        meta = {}
    run_labels = {"gpulens_run_id": meta.get("run_id"), "gpulens_run": meta.get("name")}
    gpu_labels: dict[int, dict[str, Any]] = {}
    for gpu in (meta.get("environment") or {}).get("gpus") or []:
        if isinstance(gpu.get("index"), int):
            gpu_labels[gpu["index"]] = {
                "gpu": gpu["index"], "UUID": gpu.get("uuid"), "pci_bus_id": gpu.get("pci_bus_id"),
                "device": f"nvidia{gpu['index']}", "modelName": gpu.get("name"),
                "Hostname": meta.get("hostname"),
            }  # fmt: skip
    return run_labels, gpu_labels


class LiveMetrics:
    """The latest sample of each probe (fed by the sampler) and the run's step series (read
    from its record on each scrape)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.run_labels, self.gpu_labels = record_labels(self.run_dir)
        self._gpu: dict[int, dict[str, Any]] = {}
        self._host: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def observe(self, probe_name: str, row: Mapping[str, Any]) -> None:
        # columns sampled every n-th time (energy) keep their last value in between
        fresh = {k: v for k, v in row.items() if v is not None}
        with self._lock:
            if probe_name == "gpu":
                index = int(row.get("gpu_index") or 0)
                self._gpu[index] = {**self._gpu.get(index, {}), **fresh}
            elif probe_name == "host":
                self._host = {**(self._host or {}), **fresh}

    def _steps(self, now_s: float) -> dict[str, float]:
        from gpulens.record import schema
        from gpulens.record.reader import read_series_table

        base = self.run_dir / schema.SERIES_DIR / "steps"
        try:
            table = read_series_table(base)
        except Exception as exc:  # not written yet, or mid-write: next scrape
            log.debug("steps not readable yet: %s", exc)
            return {}
        return step_window(table.to_pandas() if table.num_rows else None, now_s)

    def text(self, now_s: float) -> str:
        with self._lock:
            gpu, host = dict(self._gpu), self._host
        return render(gpu, host, self._steps(now_s), self.gpu_labels, self.run_labels)


class Tap:
    """A series writer that also shows each row to :class:`LiveMetrics`."""

    def __init__(self, writer, live: LiveMetrics, name: str):
        self._writer, self._live, self._name = writer, live, name

    def append(self, row: dict[str, Any]) -> None:
        self._writer.append(row)
        self._live.observe(self._name, row)

    def __getattr__(self, attr: str):
        return getattr(self._writer, attr)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return False


def serve(endpoint: MetricsEndpoint, text: Callable[[], str]) -> tuple[ThreadingHTTPServer, str]:
    """Serve ``GET /metrics`` (``text()``) in a daemon thread; returns the server and its URL.
    A port in use, or an address this machine does not have, is a :class:`UsageError`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the standard library's name)
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            try:
                body = text().encode()
            except Exception as exc:  # a scrape must never take the sampler down
                log.warning("could not render /metrics: %s", exc)
                self.send_error(500, "gpulens could not read the run's metrics")
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args):  # scrapes are not news
            log.debug("metrics: " + fmt, *args)

    family = socket.AF_INET6 if ":" in endpoint.host else socket.AF_INET
    server_cls = type("MetricsServer", (ThreadingHTTPServer,), {"address_family": family})
    try:
        server = server_cls((endpoint.host, endpoint.port), Handler)
    except OSError as exc:
        raise UsageError(_bind_error(endpoint, exc)) from None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="gpulens-metrics", daemon=True).start()
    host, port = server.server_address[:2]
    if not _is_loopback(endpoint.host):
        log.warning("Prometheus metrics are served to the network on %s:%s", host, port)
    shown = f"[{host}]" if ":" in str(host) else host
    return server, f"http://{shown}:{port}/metrics"


def start_live_metrics(
    endpoint: MetricsEndpoint, run_dir: Path, series: Mapping[str, Any]
) -> tuple[ThreadingHTTPServer, str, dict[str, Any]]:
    """Serve ``/metrics`` for the run in ``run_dir``; returns the server, its URL and
    ``series`` wrapped so that every sampled row also reaches the endpoint."""
    live = LiveMetrics(run_dir)
    server, url = serve(endpoint, lambda: live.text(time.time()))
    return server, url, {name: Tap(writer, live, name) for name, writer in series.items()}
