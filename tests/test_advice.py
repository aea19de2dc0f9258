"""Advice after a run is analysis (gpulens.run.advice), the terminal only renders it."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from gpulens.report.terminal import COMPARE_TIP, next_steps, render_train_summary
from gpulens.run.advice import LOW_GPU_UTIL_PCT, LOW_MFU_FP32, Advice, advise
from gpulens.run.thresholds import LOADER_BOUND_DATA_WAIT

GOOD = {
    "workload": "resnet50",
    "device": "cuda:0",
    "precision": "bf16",
    "batch_size": 64,
    "measured_steps": 100,
    "warmup_steps": 10,
    "stop_reason": "steps",
    "workers": 8,
    "phases_s": {"data_wait": 0.001, "h2d": 0.001, "compute": 0.098, "step": 0.100},
    "gpu": {"name": "H100", "gpu_util_pct": 97.0},
    "host": {},
    "mfu": 0.45,
    "throughput_samples_per_s": 640.0,
    "throughput_ci95_pct": 1.0,
}


def _with_wait(share: float) -> dict:
    return {**GOOD, "phases_s": {**GOOD["phases_s"], "data_wait": share * 0.1, "step": 0.1}}


def test_a_healthy_run_gets_no_advice():
    assert advise(GOOD) == []
    assert next_steps(GOOD) == [COMPARE_TIP]


def test_loader_bound_uses_the_one_threshold():
    assert LOADER_BOUND_DATA_WAIT == 0.20
    assert advise(_with_wait(0.15)) == []  # the old 10% bar advised here
    (a,) = advise(_with_wait(0.20))
    assert a.key == "loader_bound" and a.metric == "data_wait_share"
    assert a.threshold == LOADER_BOUND_DATA_WAIT and a.value == pytest.approx(0.20)
    assert "waits for data 20% of each step" in a.text and "(this run had 8)" in a.text
    assert [x.key for x in advise(_with_wait(0.5))] == ["loader_bound"]


def test_each_bar():
    low_util = {**GOOD, "gpu": {"gpu_util_pct": LOW_GPU_UTIL_PCT - 1}}
    assert [a.key for a in advise(low_util)] == ["low_gpu_util"]
    assert [a.key for a in advise({**GOOD, "gpu": {"gpu_util_pct": LOW_GPU_UTIL_PCT}})] == []
    low_mfu = {**GOOD, "mfu": LOW_MFU_FP32 - 0.01}
    assert advise(low_mfu) == []  # bf16 already uses the tensor cores
    (a,) = advise({**low_mfu, "precision": "fp32"})
    assert a.key == "low_mfu_fp32" and a.threshold == LOW_MFU_FP32
    (a,) = advise({**GOOD, "throughput_ci95_pct": 7.5})
    assert a.key == "wide_ci" and "±7.5%" in a.text
    (a,) = advise({**GOOD, "device": "cpu", "gpu": None, "mfu": None})
    assert a.key == "ran_on_cpu" and a.metric is None


def test_low_utilization_advice_fits_the_run():
    """A bf16 run was told to try --precision bf16 (seen on an H100 in the README's tour), and a
    loader-bound one to raise its batch size, where the GPU idles waiting for data."""
    low = {**GOOD, "gpu": {"gpu_util_pct": 50.0}}
    (a,) = advise(low)
    assert "larger --batch-size gives" in a.text and "bf16" not in a.text
    (a,) = advise({**low, "precision": "fp32", "mfu": 0.5})
    assert "larger --batch-size or --precision bf16 gives" in a.text
    loader, util = advise({**_with_wait(0.5), "gpu": {"gpu_util_pct": 50.0}})
    assert loader.key == "loader_bound" and util.key == "low_gpu_util"
    assert "waits for data" in util.text and "--batch-size" not in util.text


def test_most_telling_first_and_missing_numbers_are_no_advice():
    bad = {
        **_with_wait(0.6),
        "gpu": {"gpu_util_pct": 30.0},
        "mfu": 0.1,
        "precision": "fp32",
        "throughput_ci95_pct": 9.0,
    }
    keys = [a.key for a in advise(bad)]
    assert keys == ["loader_bound", "low_gpu_util", "low_mfu_fp32", "wide_ci"]
    assert advise({}) == []
    assert advise({"phases_s": {"step": 0}, "gpu": None, "mfu": None}) == []


def test_advice_is_frozen_and_the_terminal_renders_it():
    a = Advice(key="k", text="t")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.key = "x"  # type: ignore[misc]
    summary = {**_with_wait(0.5), "host": {"cpu_util_pct": 50.0}}
    buf = io.StringIO()
    render_train_summary(Console(file=buf, width=300), "r1", Path("/x"), summary)
    text = buf.getvalue()
    assert "waits for data 50% of each step" in text
    assert COMPARE_TIP in text


def test_a_run_without_a_gpu_shows_its_gpu_lines_as_n_a():
    """The README: a metric this machine cannot measure is shown as n/a, never left out."""
    buf = io.StringIO()
    summary = {**GOOD, "device": "cpu", "gpu": None, "mfu": None}
    render_train_summary(Console(file=buf, width=120), "r1", Path("/x"), summary)
    (line,) = [x for x in buf.getvalue().splitlines() if x.startswith("GPU")]
    assert "n/a" in line and "utilization" in line


def test_advice_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import gpulens.run.advice"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
