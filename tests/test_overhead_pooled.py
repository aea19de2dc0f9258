"""benchmarks/overhead_pooled.py on interleaved overhead results recorded on H200s: one run
pools to its own ratio, several to a ratio between theirs with a narrower interval."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
H200_RUNS = sorted(RESULTS.glob("overhead_interleaved-*-NVIDIA_H200-2026-11-26.json"))


def _pooled_module():
    path = RESULTS.parent / "overhead_pooled.py"
    spec = importlib.util.spec_from_file_location("overhead_pooled", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_run_pools_to_its_own_ratio():
    pooled = _pooled_module()
    path = RESULTS / "overhead_interleaved-027c26f-NVIDIA_H200-2026-11-26.json"
    own = json.loads(path.read_text())["cases"]["r18_b1"]["full"]
    (runs,) = [v for k, v in pooled.load_runs([path]).items() if k[1:] == ("r18_b1", "full")]
    p = pooled.pool(runs)
    assert p["runs"] == 1 and p["pairs"] == own["pairs"]
    assert p["ratio"] == pytest.approx(own["ratio"], abs=2e-4)
    lo, hi = p["ratio_ci95"]
    assert lo == pytest.approx(own["ratio_ci95"][0], abs=3e-3)
    assert hi == pytest.approx(own["ratio_ci95"][1], abs=3e-3)


def test_runs_on_several_machines_pool_between_them_with_a_narrower_interval():
    pooled = _pooled_module()
    runs = pooled.load_runs(H200_RUNS)[("NVIDIA H200", "r18_b1", "full")]
    assert len(runs) >= 4
    p = pooled.pool(runs)
    ratios = [r["ratio"] for r in runs]
    assert min(ratios) < p["ratio"] < max(ratios)
    widths = [
        json.loads((RESULTS / f).read_text())["cases"]["r18_b1"]["full"]["ratio_ci95"]
        for f in p["files"]
    ]
    assert p["ratio_ci95"][1] - p["ratio_ci95"][0] < min(hi - lo for lo, hi in widths)


def test_a_committed_pooled_table_matches_its_inputs():
    pooled = _pooled_module()
    doc = json.loads(
        (RESULTS / "overhead_pooled-since_24d8ca2-H100_H200-2026-11-26.json").read_text()
    )
    for key, row in doc["pooled"].items():
        gpu, case, arm = key.split(" | ")
        runs = pooled.load_runs([RESULTS / f for f in row["files"]])[(gpu, case, arm)]
        again = pooled.pool(runs)
        assert again["ratio"] == row["ratio"]
        assert again["median_pair_ratio"] == row["median_pair_ratio"]
        lo, hi = row["median_pair_ratio_ci95"]
        assert lo <= row["median_pair_ratio"] <= hi
