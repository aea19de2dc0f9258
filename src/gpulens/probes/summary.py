"""Summaries of the monitor's series over a run's measured window."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd


def _mean(series: pd.Series) -> float | None:
    s = series.dropna()
    return float(s.mean()) if len(s) else None


def _max(series: pd.Series) -> float | None:
    s = series.dropna()
    return float(s.max()) if len(s) else None


def summarize_gpu(
    gpu: pd.DataFrame, t0_unix_s: float, t1_unix_s: float, gpu_index: int, samples: int | None
) -> dict[str, Any] | None:
    """Means over [t0, t1] for one GPU; energy from the counter's difference (power integral if
    the counter is unsupported). None when there are no samples for that GPU."""
    if gpu.empty or "gpu_index" not in gpu:
        return None
    g = gpu[gpu["gpu_index"] == gpu_index].sort_values("time_unix_s")
    window = g[(g["time_unix_s"] >= t0_unix_s) & (g["time_unix_s"] <= t1_unix_s)]
    if window.empty:
        window = g
    if window.empty:
        return None
    out: dict[str, Any] = {
        "gpu_index": gpu_index,
        "samples": len(window),
        "gpu_util_pct": _mean(window["gpu_util_pct"]),
        "mem_util_pct": _mean(window["mem_util_pct"]),
        "mem_used_max_bytes": _max(window["mem_used_bytes"]),
        "power_mean_w": _mean(window["power_w"]),
        "sm_clock_mean_mhz": _mean(window["sm_clock_mhz"]),
        "sm_activity_pct": _mean(window.get("sm_activity_pct", pd.Series(dtype=float))),
        "sm_occupancy_pct": _mean(window.get("sm_occupancy_pct", pd.Series(dtype=float))),
        "tensor_activity_pct": _mean(window.get("tensor_activity_pct", pd.Series(dtype=float))),
        "dram_bw_util_pct": _mean(window.get("dram_bw_util_pct", pd.Series(dtype=float))),
        "pcie_rx_mean_bytes_per_s": _mean(
            window.get("pcie_rx_bytes_per_s", pd.Series(dtype=float))
        ),
        "pcie_tx_mean_bytes_per_s": _mean(
            window.get("pcie_tx_bytes_per_s", pd.Series(dtype=float))
        ),
    }
    throttle = window.get("throttle_reasons")
    if throttle is not None and throttle.notna().any():
        bits = 0
        for value in throttle.dropna():
            bits |= int(value)
        out["throttle_reasons_seen"] = bits
    energy = window["energy_j"].dropna() if "energy_j" in window else pd.Series(dtype=float)
    duration_s = float(window["time_unix_s"].iloc[-1] - window["time_unix_s"].iloc[0])
    if len(energy) >= 2:
        out["energy_j"] = float(energy.iloc[-1] - energy.iloc[0])
        out["energy_source"] = "nvml_energy_counter"
    elif out["power_mean_w"] is not None and duration_s > 0:
        out["energy_j"] = out["power_mean_w"] * duration_s
        out["energy_source"] = "power_integral"
    else:
        out["energy_j"] = None
    if out["energy_j"] is not None and samples:
        # Scale to the whole measured window: the sampled span is a little shorter than it.
        span = max(duration_s, 1e-9)
        window_s = max(t1_unix_s - t0_unix_s, span)
        out["energy_per_sample_j"] = out["energy_j"] * (window_s / span) / samples
    else:
        out["energy_per_sample_j"] = None
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def summarize_host(host: pd.DataFrame, t0_unix_s: float, t1_unix_s: float) -> dict[str, Any]:
    if host.empty:
        return {}
    window = host[(host["time_unix_s"] >= t0_unix_s) & (host["time_unix_s"] <= t1_unix_s)]
    if window.empty:
        window = host
    return {
        "cpu_util_pct": _mean(window["cpu_util_pct"]),
        "proc_tree_cpu_pct": _mean(window["proc_tree_cpu_pct"]),
        "mem_used_max_bytes": _max(window["mem_used_bytes"]),
        "disk_read_mean_bytes_per_s": _mean(window["disk_read_bytes_per_s"]),
    }
