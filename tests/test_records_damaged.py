"""A damaged run record (run.json truncated, empty or not an object; a truncated Parquet file)
is named with the fix, and never breaks `runs list/show/compare` or `load_runs()` for the rest."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
import pytest

from gpulens.cli import main
from gpulens.errors import DamagedRecordError
from gpulens.record.reader import (
    DamagedRecord,
    inspect_record,
    list_records,
    read_record,
    scan_records,
)
from gpulens.record.writer import RunWriter
from gpulens.store.queries import find_run, load_runs, series_info

GOOD = "20240401-000001-900d00"
BAD_PARQUET = "20240401-000002-ba0900"
SCHEMA = pa.schema([("time_unix_s", pa.float64()), ("power_w", pa.float64())])

# run.json contents and the problem the message must name
DAMAGED = {
    "20240401-000010-aaaaaa": (b'{"run_id": "20240401-000010-aaaaaa", "status": "fin', "truncated"),
    "20240401-000011-bbbbbb": (b"", "is empty"),
    "20240401-000012-cccccc": (b"[1, 2, 3]", "holds a JSON list, not an object"),
    "20240401-000013-dddddd": (b'"finished"', "holds a JSON str, not an object"),
    "20240401-000014-eeeeee": (b'{"status": "finished"}', "has no 'run_id'"),
    "20240401-000015-ffffff": (b"\xff\xfe garbage", "not UTF-8"),
    "20240401-000016-111111": (b"{not json}", "is not valid JSON"),
}


def _finished(runs: Path, run_id: str, throughput: float) -> Path:
    w = RunWriter(runs, kind="train", name=run_id[-6:], run_id=run_id)
    w.update(
        effective_config={"workload": "tiny_cnn", "batch_size": 8, "device": "cpu"},
        summary={"workload": "tiny_cnn", "device": "cpu", "throughput_samples_per_s": throughput},
    )
    series = w.series("gpu", SCHEMA)
    for i in range(5):
        series.append({"time_unix_s": time.time() + i, "power_w": 100.0 + i})
    w.finish()
    return runs / run_id


@pytest.fixture
def runs(gpulens_home) -> Path:
    runs = gpulens_home / "runs"
    _finished(runs, GOOD, 100.0)
    bad = _finished(runs, BAD_PARQUET, 90.0)
    parquet = bad / "series" / "gpu.parquet"
    data = parquet.read_bytes()
    parquet.write_bytes(data[: len(data) // 2])  # truncated
    for run_id, (content, _) in DAMAGED.items():
        d = _finished(runs, run_id, 50.0)  # the series stay readable
        (d / "run.json").write_bytes(content)
    return runs


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_reader_names_what_is_wrong(runs):
    for run_id, (_, problem) in DAMAGED.items():
        found = inspect_record(runs / run_id)
        assert isinstance(found, DamagedRecord)
        assert problem in found.message()
        assert str(runs / run_id / "run.json") in found.message()
        assert "gpu" in found.readable  # what can still be read
        with pytest.raises(DamagedRecordError) as info:
            read_record(runs / run_id)
        assert info.value.path == runs / run_id / "run.json"
        assert info.value.exit_code == 1
    good, damaged = scan_records(runs)
    assert {r.run_id for r in good} == {GOOD, BAD_PARQUET}
    assert {d.run_id for d in damaged} == set(DAMAGED)
    assert {r.run_id for r in list_records(runs)} == {GOOD, BAD_PARQUET}


def test_truncated_parquet_is_named_and_the_rest_reads(runs):
    record = find_run(BAD_PARQUET)
    (info,) = series_info(record)
    assert info["rows"] is None and "gpu.parquet" in info["damaged"]
    with pytest.raises(DamagedRecordError, match="gpu.parquet"):
        record.series("gpu")


def test_load_runs_lists_damaged_records_with_their_status(runs):
    df = load_runs()
    statuses = dict(zip(df["run_id"], df["status"], strict=True))
    assert statuses[GOOD] == "finished" and statuses[BAD_PARQUET] == "finished"
    assert all(statuses[run_id] == "damaged" for run_id in DAMAGED)
    errors = dict(zip(df["run_id"], df["error"], strict=True))
    assert "run.json is empty" in errors["20240401-000011-bbbbbb"]


def test_runs_list_shows_damaged_records(capsys, runs):
    code, out, err = run_cli(capsys, "runs", "list", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["total"] == 2 + len(DAMAGED) and doc["damaged"] == len(DAMAGED)
    rows = {r["run_id"]: r for r in doc["runs"]}
    assert rows[GOOD]["status"] == "finished"
    assert rows["20240401-000012-cccccc"]["status"] == "damaged"
    assert "not an object" in rows["20240401-000012-cccccc"]["error"]
    code, out, err = run_cli(capsys, "runs", "list", "--status", "damaged", "--json")
    assert len(json.loads(out)["runs"]) == len(DAMAGED)
    code, out, err = run_cli(capsys, "runs", "list")
    assert code == 0, err
    assert "damaged" in out and GOOD in out
    assert "run.json is empty" in " ".join(err.split())


def test_runs_show_on_a_damaged_record_is_one_line_exit_1(capsys, runs):
    code, out, err = run_cli(capsys, "runs", "show", "20240401-000010-aaaaaa")
    assert code == 1
    assert len(err.strip().splitlines()) == 1
    assert "run.json is truncated" in err and "rm -r" in err and "gpu" in err
    assert "internal error" not in err
    code, out, err = run_cli(capsys, "runs", "show", "20240401-000011", "--json")
    assert code == 1
    error = json.loads(out)["error"]
    assert error["type"] == "runtime_error" and error["exception"] == "DamagedRecordError"
    assert error["path"].endswith("20240401-000011-bbbbbb/run.json")
    code, out, err = run_cli(capsys, "runs", "show", str(runs / "20240401-000012-cccccc"))
    assert code == 1 and "not an object" in err  # by path too


def test_runs_show_with_a_truncated_parquet_shows_the_rest(capsys, runs):
    code, out, err = run_cli(capsys, "runs", "show", BAD_PARQUET, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["run_id"] == BAD_PARQUET
    assert doc["summary"]["throughput_samples_per_s"] == 90.0
    (series,) = doc["series"]
    assert "gpu.parquet" in series["damaged"]
    code, out, err = run_cli(capsys, "runs", "show", BAD_PARQUET)
    assert code == 0, err
    assert "gpu.parquet" in " ".join(err.split())


def test_compare_and_export_name_the_damaged_file(capsys, runs, tmp_path):
    code, out, err = run_cli(capsys, "runs", "compare", GOOD, BAD_PARQUET, "--json")
    assert code == 0, err  # compare reads run.json only
    code, out, err = run_cli(capsys, "runs", "compare", GOOD, "20240401-000013-dddddd")
    assert code == 1 and "20240401-000013-dddddd" in err and "run.json" in err
    code, out, err = run_cli(
        capsys, "runs", "export", BAD_PARQUET, "--out", str(tmp_path / "e"), "-f", "csv"
    )
    assert code == 1 and "gpu.parquet" in err and "internal error" not in err
    assert not (tmp_path / "e").exists()  # nothing half-written
    code, out, err = run_cli(capsys, "runs", "show", "latest", "--json")
    assert code == 0  # 'latest' is the newest readable record


def test_a_truncated_string_is_named_without_a_doubled_word(tmp_path):
    run = tmp_path / "20240401-000020-abcdef"
    run.mkdir()
    (run / "run.json").write_text('{"run_id": "20240401-000020-abcdef", "sta')
    found = inspect_record(run)
    assert isinstance(found, DamagedRecord) and "is truncated" in found.problem
    assert " at at " not in found.problem
