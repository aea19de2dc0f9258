"""Analysis on a record made by `gpulens run resnet50 --precision bf16 --data JPEGs --workers 15`
on a real H100 (benchmarks/gpu_session.sh, 2026-11-22)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import gpulens
from gpulens.probes.summary import summarize_gpu, summarize_host
from gpulens.record.reader import read_record
from gpulens.stats import throughput_ci

FIXTURE = Path(__file__).parent / "fixtures" / "record_h100_resnet50_jpeg"


@pytest.fixture
def record():
    return read_record(FIXTURE)


def test_record_reads_as_finished_with_all_series(record):
    assert record.status == "finished"
    assert set(record.series_names()) == {"gpu", "host", "steps"}
    env = record.meta["environment"]
    assert env["gpu_model"] == "NVIDIA H100 80GB HBM3"
    assert record.meta["effective_config"]["workers"] == 15
    assert record.meta["unsupported"] == {}  # everything measurable on Hopper was measured


def test_gpu_summary_recomputed_from_samples_matches_the_stored_one(record):
    s = record.meta["summary"]
    steps = record.series("steps")
    measured = steps[~steps["warmup"]]
    t0 = measured["time_unix_s"].iloc[0] - measured["step_time_s"].iloc[0]
    gpu = summarize_gpu(
        record.series("gpu"), t0, measured["time_unix_s"].iloc[-1] + 0.05, 0,
        s["batch_size"] * s["measured_steps"],
    )  # fmt: skip
    stored = s["gpu"]
    assert gpu["energy_source"] == "nvml_energy_counter"
    assert gpu["energy_j"] == pytest.approx(stored["energy_j"], rel=0.05)
    assert gpu["gpu_util_pct"] == pytest.approx(stored["gpu_util_pct"], abs=3)
    assert gpu["sm_activity_pct"] == pytest.approx(stored["sm_activity_pct"], abs=3)
    # A training step at full clocks on an H100 draws far more than idle power and stays in TDP.
    assert 150 < gpu["power_mean_w"] <= 700
    # GPM: SM activity cannot exceed what utilization (any kernel running) allows
    assert gpu["sm_activity_pct"] <= gpu["gpu_util_pct"] + 1


def test_steps_give_the_stored_throughput_and_ci(record):
    s = record.meta["summary"]
    steps = record.series("steps")
    measured = steps[~steps["warmup"]]
    assert len(measured) == s["measured_steps"]
    ci = throughput_ci(measured["step_time_s"], s["batch_size"])
    assert ci.samples_per_s == pytest.approx(s["throughput_samples_per_s"], rel=0.02)
    assert ci.ci95_pct == pytest.approx(s["throughput_ci95_pct"], rel=0.01)
    # GPU phases come from CUDA events: copy + compute fit inside the GPU's step period
    both = measured.dropna(subset=["gpu_step_time_s"])
    assert (both["h2d_s"] + both["compute_s"] <= both["gpu_step_time_s"] * 1.01 + 1e-4).all()


def test_host_summary_sees_the_15_workers(record):
    host = summarize_host(record.series("host"), 0, float("inf"))
    assert host["proc_tree_cpu_pct"] > 800  # 15 decoding workers keep many cores busy


def test_load_series_over_a_store_holding_the_record(gpulens_home, record):
    shutil.copytree(FIXTURE, gpulens_home / "runs" / record.run_id)
    runs = gpulens.load_runs()
    assert list(runs["run_id"]) == [record.run_id]
    gpu = gpulens.load_series(record.run_id, "gpu")
    assert {"sm_activity_pct", "tensor_activity_pct", "dram_bw_util_pct"} <= set(gpu.columns)
    assert gpu["power_w"].notna().all()


SYNTHETIC = Path(__file__).parent / "fixtures" / "record_h100_resnet50_synthetic"


def test_steady_gpu_run_gets_its_interval_from_the_gpus_step_times():
    """The ingestion-free run of `gpulens stalls resnet50 --precision bf16` on an H100
    (2026-11-23): 120 steps, 4 s. The host's step times carry the asynchrony at the window's
    edges (first steps fast while the queue fills, the last slow at the synchronize) and give
    about ±2.8%; the GPU's own step times show the steady ~3766 samples/s to ±0.2%."""
    from gpulens.workloads.loop import ci_step_times

    rec = read_record(SYNTHETIC)
    steps = rec.series("steps")
    rows = [
        {k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()}
        for r in steps[~steps["warmup"]].to_dict("records")
    ]
    host = throughput_ci([r["step_time_s"] for r in rows], 128)
    gpu = throughput_ci(ci_step_times(rows), 128)
    assert host.ci95_pct > 2.0
    assert gpu.ci95_pct < 0.5
    assert gpu.samples_per_s == pytest.approx(
        rec.meta["summary"]["throughput_samples_per_s"], rel=0.01
    )
