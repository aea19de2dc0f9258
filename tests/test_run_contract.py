"""The run contract: one lifecycle for every run, and one result type for fresh and stored runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpulens.errors import MissingExtraError, RuntimeFailure, UsageError
from gpulens.record.reader import list_records, read_record
from gpulens.record.writer import RunWriter
from gpulens.run import RunResult, legacy_role, measured_run, read_result_json, role_name


def test_a_run_ends_finished_with_its_role_and_gives_the_same_result_fresh_or_stored(tmp_path):
    with measured_run(
        tmp_path,
        kind="stalls",
        name="stalls-x-cached",
        role=role_name("stalls", "cached"),
        requested_config={"workload": "x"},
        capture_environment=False,
    ) as run:
        run.set_effective({"workload": "x", "workers": 3})
        run.set_summary({"throughput_samples_per_s": 100.0, "workers": 3})
    fresh = run.result()
    stored = read_record(run.dir).result()
    assert fresh == stored
    assert stored.status == "finished" and stored.role == "stalls:cached"
    assert stored.experiment_role == "cached" and stored.loader_workers == 3
    assert stored.throughput_samples_per_s == 100.0
    assert RunResult.from_dict(stored.as_dict()) == stored
    assert read_result_json(run.dir) == stored
    with pytest.raises(TypeError):
        stored.summary["workers"] = 4  # results are read-only views


def test_every_way_a_run_ends_is_recorded(tmp_path):
    with (
        pytest.raises(KeyboardInterrupt) as caught,
        measured_run(tmp_path, kind="train", capture_environment=False),
    ):
        raise KeyboardInterrupt
    assert read_record(caught.value.gpulens_record_dir).status == "killed"

    with (
        pytest.raises(ValueError) as caught,
        measured_run(tmp_path, kind="train", capture_environment=False),
    ):
        raise ValueError("bad thing")
    rec = read_record(caught.value.gpulens_record_dir)
    assert rec.status == "failed" and rec.meta["error"] == "bad thing"

    class OutOfMemoryError(RuntimeError):
        pass

    OutOfMemoryError.__module__ = "torch.cuda"
    with (
        pytest.raises(RuntimeFailure, match="lower --batch-size") as caught,
        measured_run(tmp_path, kind="train", capture_environment=False) as run,
    ):
        run.oom_hint = "CUDA out of memory: lower --batch-size"
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate")
    assert read_record(caught.value.gpulens_record_dir).meta["error"].startswith("CUDA out of")

    with measured_run(tmp_path, kind="command", capture_environment=False) as run:
        run.end_as("failed", "command exited with code 3")
    assert read_record(run.dir).status == "failed"


def test_a_usage_error_before_anything_is_measured_leaves_no_record(tmp_path):
    for refusal in (UsageError("use --device cpu"), MissingExtraError("aiohttp", "serve")):
        with (
            pytest.raises(type(refusal)) as caught,
            measured_run(tmp_path, kind="colocate", capture_environment=False) as run,
        ):
            run.set_effective({"device": "cpu"})
            raise refusal
        assert not hasattr(caught.value, "gpulens_record_dir")
        assert not run.dir.exists() and list(tmp_path.iterdir()) == []


def test_a_usage_error_once_measuring_began_is_still_recorded_as_failed(tmp_path):
    from gpulens.record.schema import STEPS_SCHEMA

    def refused_after(begin) -> str:
        with (
            pytest.raises(UsageError) as caught,
            measured_run(tmp_path, kind="train", capture_environment=False) as run,
        ):
            begin(run)
            raise UsageError("bad sample: use --skip-bad-samples")
        rec = read_record(caught.value.gpulens_record_dir)
        assert rec.status == "failed" and rec.meta["error"].startswith("bad sample")
        return rec.run_id

    # a series opened by the run, a file a child process wrote into the record
    ids = [
        refused_after(lambda run: run.writer.series("steps", STEPS_SCHEMA).append({"step": 0})),
        refused_after(lambda run: (run.dir / "rank0.log").write_text("started")),
    ]
    # a record opened by someone else (a node's shard) stays its opener's to end
    adopted = RunWriter(tmp_path, kind="train")
    with pytest.raises(UsageError), measured_run(tmp_path, kind="train", writer=adopted,
                                                 capture_environment=False):  # fmt: skip
        raise UsageError("refused")
    assert read_record(adopted.dir).status == "failed"
    assert sorted(r.run_id for r in list_records(tmp_path)) == sorted([*ids, adopted.run_id])


def test_old_records_without_a_role_get_the_one_their_name_implies():
    old = {"run_id": "r", "kind": "stalls", "name": "stalls-resnet50-paired_cold"}
    assert legacy_role(old) == "stalls:paired_cold"  # not "cold"
    assert legacy_role({**old, "name": "stalls-resnet50-cold"}) == "stalls:cold"
    assert legacy_role({"run_id": "r", "kind": "train", "name": "x-cold"}) is None
    result = RunResult.from_dict(old, "/tmp/r")
    assert result.role == "stalls:paired_cold"


def test_the_contract_imports_without_torch_or_pandas():
    code = (
        "import sys\n"
        "for m in ('torch', 'pandas', 'pyarrow'): sys.modules[m] = None\n"
        "import gpulens.run, gpulens.run.result\n"
        "print(gpulens.run.RunResult.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.dumps(out.stdout.strip()) == '"RunResult"'


def test_figures_computed_after_a_run_reach_its_run_json(tmp_path):
    from gpulens.record.writer import amend_summary

    with measured_run(tmp_path, kind="stalls", capture_environment=False) as run:
        run.set_summary({"throughput_samples_per_s": 10.0})
    amend_summary(run.dir, paired_fetch={"extra_s_per_sample": 0.001})
    result = read_record(run.dir).result()
    assert result.summary["paired_fetch"]["extra_s_per_sample"] == 0.001
    assert result.throughput_samples_per_s == 10.0
