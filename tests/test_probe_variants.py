"""benchmarks/probe_variants.py: the copy that scores `predict --workers` without the probe."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from probe_variants import VARIANTS, without  # noqa: E402


def _bundle(path: Path, metas: dict[str, dict]) -> None:
    with tarfile.open(path, "w:xz") as tar:
        for run_id, meta in metas.items():
            for name, data in (("run.json", json.dumps(meta)), ("series/steps.arrows", "rows")):
                blob = data.encode()
                info = tarfile.TarInfo(f"runs/{run_id}/{name}")
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))


def test_every_probe_goes_and_every_other_byte_stays(tmp_path):
    probe = {"processes": [1, 2], "samples_per_s_per_process": [200.0, 190.0], "window_s": 0.5}
    pipeline = {"workers": [1, 2], "samples_per_s_per_worker": [180.0, 170.0], "rounds": 2}
    metas = {
        "both": {"summary": {"x": 1}, "loader_scaling": probe, "loader_pipeline_scaling": pipeline},
        "process": {"summary": {"x": 2}, "loader_scaling": probe},
        "none": {"summary": {"x": 3}},
    }
    _bundle(tmp_path / "in.tar.xz", metas)
    changed = without(tmp_path / "in.tar.xz", tmp_path / "out.tar.xz", VARIANTS["no_probe"])
    assert changed == 2
    with tarfile.open(tmp_path / "out.tar.xz") as tar:
        got = {
            m.name: tar.extractfile(m).read() for m in tar if m.isfile()
        }  # fmt: skip
    for run_id, meta in metas.items():
        kept = json.loads(got[f"runs/{run_id}/run.json"])
        assert kept == {"summary": meta["summary"]}
        assert got[f"runs/{run_id}/series/steps.arrows"] == b"rows"
