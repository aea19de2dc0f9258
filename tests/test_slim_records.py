"""benchmarks/slim_records.py shrinks committed record tarballs: what it drops must be what
`gpulens predict` never reads, so a prediction from a slimmed record is the same."""

from __future__ import annotations

import gzip
import importlib.util
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from gpulens.predict.predictor import Target, predict_run
from gpulens.record.reader import read_record

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RUN = Path(__file__).parent / "fixtures" / "predict_batch_h200" / "20261126-021116-a2df18"


def _slim_module():
    spec = importlib.util.spec_from_file_location("slim_records", BENCHMARKS / "slim_records.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _as_committed(tmp_path: Path) -> Path:
    """The fixture run as a ladder bundles it: runs/<id>/ with a plain torch_trace.json."""
    run = tmp_path / "src" / "runs" / RUN.name
    shutil.copytree(RUN, run)
    trace = run / "torch_trace.json.gz"
    (run / "torch_trace.json").write_bytes(gzip.decompress(trace.read_bytes()))
    trace.unlink()
    meta = json.loads((run / "run.json").read_text())
    meta["torch_profiler"]["file"] = "torch_trace.json"
    (run / "run.json").write_text(json.dumps(meta))
    bundle = tmp_path / "full.tgz"
    with tarfile.open(bundle, "w:gz") as tar:
        tar.add(tmp_path / "src" / "runs", arcname="runs")
    return bundle


@pytest.mark.parametrize("suffix", [".tar.xz", ".tgz"])
def test_a_slimmed_record_predicts_the_same(tmp_path, monkeypatch, suffix):
    monkeypatch.setenv("GPULENS_HOME", str(tmp_path / "home"))
    bundle = _as_committed(tmp_path)
    slim = tmp_path / f"slim{suffix}"
    assert _slim_module().main(str(bundle), str(slim)) == 0
    # xz where asked (a third smaller than gzip on the ladders), gzip otherwise
    assert slim.read_bytes().startswith(b"\xfd7zXZ\x00" if suffix == ".tar.xz" else b"\x1f\x8b")
    for name, path in (("full", bundle), ("slim", slim)):
        with tarfile.open(path) as tar:
            tar.extractall(tmp_path / name, filter="data")
    full = read_record(tmp_path / "full" / "runs" / RUN.name)
    slimmed = read_record(tmp_path / "slim" / "runs" / RUN.name)
    for target in (Target(None, batch_size=512), Target(None, batch_size=32), Target("H100")):
        a, b = predict_run(full, target), predict_run(slimmed, target)
        assert b.step_time_s == a.step_time_s
        assert b.notes == a.notes
    # what was dropped: kernels' occupancy and launch geometry, and the trace's whitespace
    trace = json.loads((tmp_path / "slim" / "runs" / RUN.name / "torch_trace.json").read_text())
    kernel = next(e for e in trace["traceEvents"] if e.get("cat") == "kernel")
    assert set(kernel["args"]) <= {"External id", "stream", "correlation", "device"}
    assert trace["slimmed"] == "benchmarks/slim_records.py"
    sizes = {n: (tmp_path / n / "runs" / RUN.name / "torch_trace.json").stat().st_size
             for n in ("full", "slim")}  # fmt: skip
    assert sizes["slim"] < 0.9 * sizes["full"]


def test_prep_rows_go_only_from_loader_bound_runs_and_predictions_stay(tmp_path, monkeypatch):
    monkeypatch.setenv("GPULENS_HOME", str(tmp_path / "home"))
    fixtures = Path(__file__).parent / "fixtures"
    bound = fixtures / "stalls_h100_resnet50_s8" / "20261124-082105-01408d"  # waited, w8
    kept_up = fixtures / "record_h100_resnet50_jpeg"  # its loader kept up
    runs = tmp_path / "src" / "runs"
    for run in (bound, kept_up):
        shutil.copytree(run, runs / run.name)
        (runs / run.name / "series" / "prep_w0_p1.arrows").write_bytes(b"rows")
    bundle = tmp_path / "full.tgz"
    with tarfile.open(bundle, "w:gz") as tar:
        tar.add(runs, arcname="runs")
    slim = tmp_path / "slim.tar.xz"
    assert _slim_module().main(str(bundle), str(slim), drop_loader_bound_prep_rows=True) == 0
    with tarfile.open(slim) as tar:
        names = set(tar.getnames())
        note = json.load(tar.extractfile("runs/slimmed.json"))
        tar.extractall(tmp_path / "slim", filter="data")
    assert f"runs/{bound.name}/series/prep_w0_p1.arrows" not in names
    assert f"runs/{kept_up.name}/series/prep_w0_p1.arrows" in names
    assert note["runs"] == [bound.name]
    full, slimmed = (
        read_record(runs / bound.name),
        read_record(tmp_path / "slim" / "runs" / bound.name),
    )
    a, b = predict_run(full, Target(None, workers=4)), predict_run(slimmed, Target(None, workers=4))
    assert b.step_time_s == a.step_time_s and b.notes == a.notes
