"""The GPU probe replayed against pynvml call logs recorded on real GPUs (fixtures/nvml_*).

``nvml_replay.py`` serves the recorded answers; ``benchmarks/record_nvml_fixture.py`` records them.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from nvml_replay import NvmlReplay

from gpulens.probes.nvml.gpm import GPM_COLUMNS, GPM_PCIE_COLUMNS
from gpulens.probes.nvml.inventory import describe_gpus
from gpulens.probes.nvml.probe import (
    COLUMNS,
    GPU_SAMPLE_SCHEMA,
    PCIE_COLUMNS,
    NvmlGpuProbe,
    open_gpu_probe,
)

FIXTURES_DIR = Path(__file__).parent / "fixtures"
MIB = 1 << 20


# ------------------------------------------------------------------------- replay
def _fixture_dirs() -> list[Path]:
    return sorted(p for p in FIXTURES_DIR.glob("nvml_*") if (p / "raw_calls.json").is_file())


def _same(got: Any, want: Any) -> bool:
    if isinstance(got, float) and isinstance(want, float):
        return got == pytest.approx(want, rel=1e-12) or (math.isnan(got) and math.isnan(want))
    return got == want


@pytest.mark.parametrize("fixture_dir", _fixture_dirs(), ids=lambda p: p.name)
def test_replayed_fixture_gives_the_recorded_rows(
    fixture_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    replay = NvmlReplay.load(fixture_dir)
    monkeypatch.setitem(sys.modules, "pynvml", replay)
    meta_path = fixture_dir / "describe.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}

    if "describe" in replay.phases:
        described = describe_gpus()
        if "gpus" in meta:
            assert described == meta["gpus"]
    probe = open_gpu_probe(
        meta.get("gpu_indices"),
        # recorded with GPM read at every 10 Hz sample (before GPM_INTERVAL_S): replayed so
        gpm_min_interval_s=meta.get("gpm_min_interval_s", 0.09),
        monotonic=replay.monotonic,
        wall_time=replay.wall_time,
        sleep=replay.sleep,
    )
    assert isinstance(probe, NvmlGpuProbe)
    rows = []
    for _ in range(replay.sample_count()):
        rows.extend(probe.sample())
    probe.close()
    assert replay.unserved() == []  # the probe made exactly the recorded calls

    if (fixture_dir / "gpu_samples.parquet").is_file():
        expected = pq.read_table(fixture_dir / "gpu_samples.parquet").to_pylist()
    else:
        expected = json.loads((fixture_dir / "expected_rows.json").read_text())
    assert len(rows) == len(expected)
    for got, want in zip(rows, expected, strict=True):
        assert list(got) == list(COLUMNS)
        diffs = {k: (got[k], want[k]) for k in COLUMNS if not _same(got[k], want[k])}
        assert diffs == {}
    if "unsupported" in meta:
        assert set(probe.unsupported) == set(meta["unsupported"])
    if "sources" in meta:
        for index, sources in meta["sources"].items():
            assert sources.items() <= probe.sources[int(index)].items()

    # What must hold of any GPU's rows.
    pa.Table.from_pylist(rows, schema=GPU_SAMPLE_SCHEMA)
    by_gpu: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_gpu.setdefault(row["gpu_index"], []).append(row)
    for gpu_rows in by_gpu.values():
        first = gpu_rows[0]
        assert all(first[c] is None for c in (*GPM_COLUMNS, *PCIE_COLUMNS))
        energies = [r["energy_j"] for r in gpu_rows if r["energy_j"] is not None]
        assert energies == sorted(energies) and all(e >= 0 for e in energies)
        for row in gpu_rows:
            for col in probe.unsupported:
                assert row[col] is None
            for col in ("gpu_util_pct", "mem_util_pct", *GPM_COLUMNS):
                assert row[col] is None or 0.0 <= row[col] <= 100.5
            if row["mem_used_bytes"] is not None:
                assert 0 <= row["mem_used_bytes"] <= row["mem_total_bytes"]
            for col in PCIE_COLUMNS:
                assert row[col] is None or row[col] >= 0.0


def _gpm_fixture_dirs() -> list[Path]:
    return [
        p
        for p in _fixture_dirs()
        if '"nvmlGpmMetricsGet"' in (p / "raw_calls.json").read_text()
        and (p / "gpu_samples.parquet").is_file()
    ]


@pytest.mark.parametrize("fixture_dir", _gpm_fixture_dirs(), ids=lambda p: p.name)
def test_recorded_gpm_rows_follow_the_raw_metrics(fixture_dir: Path) -> None:
    """An oracle independent of the probe: each row's GPM columns from the raw NVML results."""
    recording = json.loads((fixture_dir / "raw_calls.json").read_text())
    rows = pq.read_table(fixture_dir / "gpu_samples.parquet").to_pylist()
    constants = recording["constants"]
    column_of = {constants[name]: col for col, name in GPM_COLUMNS.items()}
    column_of.update({constants[name]: col for col, name in GPM_PCIE_COLUMNS.items()})
    samples = [calls for name, calls in recording["phases"].items() if name.startswith("sample_")]
    assert len(rows) == len(samples), "one GPU per GPM fixture"
    stale = 0
    for row, calls in zip(rows, samples, strict=True):
        results = [c["ret"]["__gpm_metrics_get__"] for c in calls if c["fn"] == "nvmlGpmMetricsGet"]
        if not results:
            assert all(row[col] is None for col in column_of.values())
            continue
        (result,) = results
        values = {m["metricId"]: m["value"] for m in result["metrics"] if m["nvmlReturn"] == 0}
        if any(math.isnan(v) for v in values.values()) or not any(values.values()):
            stale += 1
            assert all(row[col] is None for col in column_of.values())
            continue
        for metric_id, value in values.items():
            col = column_of[metric_id]
            assert row[col] == (value * MIB if col in PCIE_COLUMNS else value)
    if fixture_dir.name == "nvml_h100_stale_gpm":
        assert stale == 4  # samples 3, 5, 7 and 10
