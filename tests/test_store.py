"""The store: queries over run records, export, and the MLflow sink."""

from __future__ import annotations

import builtins
import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest

from gpulens.errors import MissingExtraError, UsageError
from gpulens.record import schema as record_schema
from gpulens.record.reader import read_record
from gpulens.record.writer import RunWriter
from gpulens.store import mlflow_payload, mlflow_sink, queries

GPU_SCHEMA = pa.schema(
    [
        ("time_unix_s", pa.float64()),
        ("gpu_index", pa.int32()),
        ("gpu_util_pct", pa.float64()),
        ("power_w", pa.float64()),
        ("sm_activity_pct", pa.float64()),  # always null: unsupported on this "GPU"
    ]
)
HOST_SCHEMA = pa.schema([("time_unix_s", pa.float64()), ("cpu_util_pct", pa.float32())])
STEPS_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("time_unix_s", pa.float64()),
        ("warmup", pa.bool_()),
        ("step_time_s", pa.float64()),
    ]
)

# MLflow's own SQLAlchemy use warns about itself; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")

IDS = {
    "a": "20240101-000001-aaa111",
    "b": "20240101-000002-aab222",
    "cmd": "20240101-000003-ccc333",
    "killed": "20240101-000004-ddd444",
}


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _train_run(runs: Path, run_id: str, name: str, batch_size: int, throughput: float, n: int):
    w = RunWriter(
        runs,
        kind="train",
        name=name,
        run_id=run_id,
        requested_config={"workload": "resnet18", "batch_size": batch_size},
        environment={
            "gpu_model": "NVIDIA H100 80GB HBM3",
            "gpu_count": 2,
            "driver_version": "550.54",
            "torch": "2.4.0",
            "hostname": "node1",
            "gpus": [{"index": 0, "name": "H100"}, {"index": 1, "name": "H100"}],
        },
    )
    w.update(
        effective_config={
            "workload": "resnet18",
            "batch_size": batch_size,
            "precision": "bf16",
            "device": "cuda:0",
            "workers": None,
            "optimizer": {"name": "sgd", "lr": 0.1},
            "note": "x" * 800,
        },
        unsupported={"sm_activity_pct": "GPM needs Hopper or newer"},
    )
    gpu, host, steps = (
        w.series("gpu", GPU_SCHEMA),
        w.series("host", HOST_SCHEMA),
        w.series("steps", STEPS_SCHEMA),
    )
    t0 = time.time()
    for i in range(n):
        for g in (0, 1):
            gpu.append(
                {
                    "time_unix_s": t0 + i * 0.1,
                    "gpu_index": g,
                    "gpu_util_pct": 50.0 + g * 10,
                    "power_w": 200.0 + i % 7,
                }
            )
        host.append({"time_unix_s": t0 + i * 0.1, "cpu_util_pct": 25.0})
    for s in range(20):
        steps.append(
            {"step": s, "time_unix_s": t0 + s, "warmup": s < 3, "step_time_s": 0.1 + s / 1000}
        )
    w.update(
        summary={
            "workload": "resnet18",
            "device": "cuda:0",
            "throughput_samples_per_s": throughput,
            "measured_steps": 17,
            "phases_s": {"data_wait": 0.01, "compute": 0.09},
            "gpu": {"gpu_util_pct": 55.0, "power_mean_w": 203.0},
            "gpus": [
                {"gpu_index": 0, "power_mean_w": 203.0},
                {"gpu_index": 1, "power_mean_w": 1.0},
            ],
            "mfu": None,
            "precision": "bf16",
        }
    )
    w.finish()
    return w.dir


def build_store(home: Path) -> dict[str, Path]:
    """Four records: two finished trainings, a failed command and a killed run."""
    runs = home / "runs"
    dirs = {
        "a": _train_run(runs, IDS["a"], "resnet-a", 32, 1000.0, n=1200),
        "b": _train_run(runs, IDS["b"], "resnet-b", 64, 1250.0, n=30),
    }
    w = RunWriter(
        runs,
        kind="command",
        run_id=IDS["cmd"],
        requested_config={"command": "python train.py", "sample_hz": 10.0},
        environment={"gpu_count": 0, "gpu_model": None},
    )
    w.update(effective_config={"command": "python train.py"}, summary={"wall_s": 1.5, "gpu": None})
    w.finish("failed", error="command exited with code 3")
    dirs["cmd"] = w.dir
    # A killed run: its owner died while the record said "running"; a series stays a live stream.
    w = RunWriter(runs, kind="train", run_id=IDS["killed"], name="doomed")
    series = w.series("gpu", GPU_SCHEMA)
    series.append({"time_unix_s": time.time(), "gpu_index": 0, "gpu_util_pct": 99.0})
    series.flush()
    w._stop.set()  # no more heartbeats: the "process" is gone
    w.meta["pid"] = _dead_pid()
    w.save()
    dirs["killed"] = w.dir
    return dirs


@pytest.fixture(scope="module")
def store_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("gpulens_home")
    build_store(home)
    return home


@pytest.fixture(autouse=True)
def _env(store_home, monkeypatch):
    monkeypatch.setenv("GPULENS_HOME", str(store_home))
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


# ----------------------------------------------------------------------------- queries
def test_load_runs_columns_and_values(store_home):
    df = queries.load_runs(store_home)
    assert list(df.columns[: len(queries.BASE_COLUMNS)]) == list(queries.BASE_COLUMNS)
    metric_cols = list(df.columns[len(queries.BASE_COLUMNS) :])
    assert metric_cols == sorted(metric_cols)
    assert list(df["run_id"]) == [IDS["a"], IDS["b"], IDS["cmd"], IDS["killed"]]
    a = df.set_index("run_id").loc[IDS["a"]]
    assert a["name"] == "resnet-a"
    assert a["status"] == "finished"
    assert a["workload"] == "resnet18"
    assert a["device"] == "cuda:0"
    assert a["gpu_model"] == "NVIDIA H100 80GB HBM3"
    assert a["throughput_samples_per_s"] == 1000.0
    assert a["phases_s.data_wait"] == 0.01
    assert a["gpu.power_mean_w"] == 203.0
    assert a["gpus.1.power_mean_w"] == 1.0
    assert a["duration_s"] >= 0
    assert "mfu" not in df.columns  # never measured: absent, not zero
    assert "workload" not in metric_cols  # a summary key that repeats a base column
    assert isinstance(df["created_at"].dtype, pd.DatetimeTZDtype)
    statuses = dict(zip(df["run_id"], df["status"], strict=True))
    assert statuses[IDS["cmd"]] == "failed"
    assert statuses[IDS["killed"]] == "killed"
    cmd = df.set_index("run_id").loc[IDS["cmd"]]
    assert cmd["workload"] == "python train.py"
    assert pd.isna(df.set_index("run_id").loc[IDS["killed"], "duration_s"])
    # the same through the package's public entry point, honouring GPULENS_HOME
    import gpulens

    assert list(gpulens.load_runs().columns) == list(df.columns)


def test_load_runs_empty(tmp_path):
    df = queries.load_runs(tmp_path)
    assert df.empty
    assert list(df.columns) == list(queries.BASE_COLUMNS)


def test_load_series(store_home):
    gpu = queries.load_series(IDS["a"], "gpu", store_home)
    assert len(gpu) == 2400
    assert set(gpu["gpu_index"]) == {0, 1}
    steps = queries.load_series(IDS["a"][:17], "steps", store_home)
    assert list(steps["step"]) == list(range(20))
    assert steps["warmup"].sum() == 3
    killed = queries.load_series(IDS["killed"], "gpu")  # from the unfinished Arrow stream
    assert list(killed["gpu_util_pct"]) == [99.0]
    assert queries.load_series(IDS["cmd"], "steps").empty  # never written
    # a series never written has its documented columns all the same (it had none, so
    # `df["warmup"]` failed on a CPU run's GPU series or a failed command's steps)
    for name, column in (("steps", "warmup"), ("gpu", "gpu_util_pct"), ("host", "cpu_util_pct")):
        empty = queries.load_series(IDS["cmd"], name)
        assert column in empty and "time_unix_s" in empty and empty.empty
    assert (
        list(queries.load_series(IDS["cmd"], "steps").columns) == record_schema.STEPS_SCHEMA.names
    )
    with pytest.raises(UsageError, match="no series 'nope'"):
        queries.load_series(IDS["a"], "nope")


def test_find_run_prefix_latest_name_and_errors(store_home):
    assert queries.find_run(IDS["cmd"]).run_id == IDS["cmd"]
    assert queries.find_run("20240101-000003").run_id == IDS["cmd"]
    assert queries.find_run("latest").run_id == IDS["killed"]
    assert queries.find_run("resnet-b").run_id == IDS["b"]
    assert queries.find_run(str(store_home / "runs" / IDS["a"])).run_id == IDS["a"]
    with pytest.raises(UsageError, match=r"no run matches 'zzz': see `gpulens runs list`"):
        queries.find_run("zzz")
    with pytest.raises(UsageError, match="matches 4 runs") as info:
        queries.find_run("20240101")
    assert info.value.exit_code == 2
    with pytest.raises(UsageError, match="no runs stored"):
        queries.find_run("latest", home=store_home / "empty")
    # a path that holds no run says so, whether or not runs are stored
    for home in (store_home, store_home / "empty"):
        with pytest.raises(UsageError, match="/nonexistent is no run directory: give a run "):
            queries.find_run("/nonexistent", home=home)
        with pytest.raises(UsageError, match="is a folder without a run.json: give a run"):
            queries.find_run(str(store_home), home=home)  # a folder holding runs/ only
        # a folder of runs (a store's runs/, an unpacked bundle) names one of them
        runs = store_home / "runs"
        with pytest.raises(UsageError, match="holds run directories: give one, e.g. ") as info:
            queries.find_run(str(runs), home=home)
        first = sorted(p for p in runs.iterdir() if (p / "run.json").is_file())[0]
        assert str(first) in str(info.value) and " more)" in str(info.value)


def test_compare_two_runs(store_home):
    a, b = queries.find_run(IDS["a"]), queries.find_run(IDS["b"])
    df = queries.compare_runs([a, b])
    assert list(df.columns) == [IDS["a"], IDS["b"], queries.REL_DIFF_COLUMN]
    index = list(df.index)
    assert index[:5] == ["name", "kind", "status", "created_at", "duration_s"]
    assert index.index("config.batch_size") < index.index("env.gpu_model")
    assert index.index("env.gpu_model") < index.index("throughput_samples_per_s")
    assert df.loc["throughput_samples_per_s", IDS["b"]] == 1250.0
    assert df.loc["throughput_samples_per_s", queries.REL_DIFF_COLUMN] == pytest.approx(25.0)
    assert df.loc["config.batch_size", queries.REL_DIFF_COLUMN] == pytest.approx(100.0)
    assert df.loc["config.optimizer.lr", IDS["a"]] == 0.1
    assert pd.isna(df.loc["name", queries.REL_DIFF_COLUMN])
    three = queries.compare_runs([a, b, queries.find_run(IDS["cmd"])])
    assert queries.REL_DIFF_COLUMN not in three.columns
    assert three.loc["wall_s", IDS["cmd"]] == 1.5
    assert three.loc["wall_s", IDS["a"]] is None
    same = queries.compare_runs([a, a])
    assert list(same.columns[:2]) == [IDS["a"], f"{IDS['a']}#2"]


def test_flatten():
    flat = queries.flatten({"a": {"b": 1, "c": None}, "l": [1, 2], "d": [{"x": 1}], "e": []})
    assert flat == {"a.b": 1, "l": [1, 2], "d.0.x": 1}
    assert queries.flatten({"a": {"c": None}}, keep_none=True) == {"a.c": None}


@pytest.mark.parametrize("fmt", ["dir", "csv", "parquet", "json"])
def test_export_formats(store_home, tmp_path, fmt):
    record = queries.find_run(IDS["a"])
    path = queries.export_run(record, tmp_path / "out", fmt)
    if fmt == "dir":
        assert (path / "run.json").is_file()
        assert (path / "series" / "gpu.parquet").is_file()
        assert read_record(path).run_id == IDS["a"]
    elif fmt == "csv":
        assert len(pd.read_csv(path / "gpu.csv")) == 2400
        assert json.loads((path / "run.json").read_text())["run_id"] == IDS["a"]
    elif fmt == "parquet":
        assert len(pd.read_parquet(path / "steps.parquet")) == 20
    else:
        doc = json.loads(path.read_text())
        assert doc["run"]["run_id"] == IDS["a"]
        assert len(doc["series"]["steps"]) == 20
        assert doc["series"]["gpu"][0]["sm_activity_pct"] is None
    with pytest.raises(UsageError, match="already exists"):
        queries.export_run(record, path, fmt)


def test_export_killed_run_compacts_stream(tmp_path):
    path = queries.export_run(queries.find_run(IDS["killed"]), tmp_path / "k", "parquet")
    assert json.loads((path / "run.json").read_text())["status"] == "killed"
    assert list(pd.read_parquet(path / "gpu.parquet")["gpu_util_pct"]) == [99.0]
    with pytest.raises(UsageError, match="unknown export format"):
        queries.export_run(queries.find_run(IDS["killed"]), tmp_path / "x", "xlsx")


# ----------------------------------------------------------------------------- mlflow
def test_key_and_value_limits():
    assert mlflow_payload.mlflow_key("a.b/c d-e_f") == "a.b/c d-e_f"
    assert mlflow_payload.mlflow_key("a@b{c}") == "a_b_c_"
    assert mlflow_payload.mlflow_key("../x") == "_x"
    assert len(mlflow_payload.mlflow_key("k" * 400)) == 250
    record = queries.find_run(IDS["a"])
    params = mlflow_payload.record_params(record)
    assert len(params["note"]) == 500 and params["note"].endswith("...")
    assert params["workers"] == "null"
    assert params["optimizer.lr"] == "0.1"
    metrics = mlflow_payload.record_metrics(record)
    assert "mfu" not in metrics and "workload" not in metrics


def test_downsampled_series_metrics():
    points = mlflow_payload.series_metrics(queries.find_run(IDS["a"]))
    keys = {p[0] for p in points}
    assert {
        "system/gpu_0_utilization_percentage", "system/gpu_1_power_usage_watts",
        "system/cpu_utilization_percentage", "steps/step_time_s",
    } <= keys  # fmt: skip
    assert not [k for k in keys if k.startswith(("gpu0/", "host/"))]
    assert not any("sm_activity_pct" in k for k in keys)  # all null: unsupported, not zero
    per_key = pd.Series([p[0] for p in points]).value_counts()
    assert per_key.max() <= mlflow_payload.MAX_SERIES_POINTS
    assert per_key["system/gpu_0_utilization_percentage"] == 500
    assert per_key["steps/step_time_s"] == 20
    steps = sorted(p[3] for p in points if p[0] == "steps/step_time_s")
    assert steps == list(range(20))


def test_system_metric_names_follow_mlflow_where_the_quantity_is_the_same():
    key = mlflow_payload.system_metric_key
    assert key("gpu", "mem_used_bytes", 1) == ("system/gpu_1_memory_usage_megabytes", 1e-6)
    assert key("gpu", "tensor_activity_pct", 0) == ("system/gpu_0_tensor_activity_pct", 1.0)
    assert key("host", "cpu_util_pct") == ("system/cpu_utilization_percentage", 1.0)
    assert key("host", "net_rx_bytes_per_s") == ("system/host_net_rx_bytes_per_s", 1.0)


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory) -> str:
    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    return f"sqlite:///{db}"


@pytest.fixture(scope="module")
def synced(store_home, tracking_uri):
    """One sync of the whole store into a fresh SQLite tracking store (timed)."""
    pytest.importorskip("mlflow")
    t0 = time.perf_counter()
    results = mlflow_sink.sync_all(store_home, tracking_uri)
    elapsed_s = time.perf_counter() - t0
    sys.stderr.write(f"\n[mlflow] first sync of {len(results)} records: {elapsed_s:.2f} s\n")
    return dict(results)


def test_sync_logs_params_metrics_tags_artifacts(synced, tracking_uri, store_home):
    from mlflow import MlflowClient

    assert set(synced) == {IDS["a"], IDS["b"], IDS["cmd"], IDS["killed"]}
    assert all(isinstance(v, str) for v in synced.values()), synced
    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(synced[IDS["a"]])
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "resnet-a"
    assert run.data.params["batch_size"] == "32"
    assert run.data.params["optimizer.name"] == "sgd"
    assert run.data.metrics["throughput_samples_per_s"] == 1000.0
    assert run.data.metrics["phases_s.data_wait"] == 0.01
    assert "mfu" not in run.data.metrics
    tags = run.data.tags
    assert tags["gpulens.run_id"] == IDS["a"]
    assert tags["gpulens.status"] == "finished"
    assert tags["gpulens.kind"] == "train"
    assert tags["env.gpu_model"] == "NVIDIA H100 80GB HBM3"
    assert tags["unsupported.sm_activity_pct"] == "GPM needs Hopper or newer"
    artifacts = {f.path for f in client.list_artifacts(run.info.run_id, "record")}
    assert "record/run.json" in artifacts
    series_files = {f.path for f in client.list_artifacts(run.info.run_id, "record/series")}
    assert "record/series/gpu.parquet" in series_files
    history = client.get_metric_history(run.info.run_id, "system/gpu_1_power_usage_watts")
    assert 0 < len(history) <= mlflow_payload.MAX_SERIES_POINTS
    # artifacts live next to the database, not in the working directory
    assert not (Path.cwd() / "mlruns").exists()
    assert (Path(tracking_uri[len("sqlite:///") :]).parent / "mlartifacts").is_dir()
    statuses = {
        rid: client.get_run(mid).info.status for rid, mid in synced.items() if rid != IDS["a"]
    }
    assert statuses == {IDS["b"]: "FINISHED", IDS["cmd"]: "FAILED", IDS["killed"]: "KILLED"}
    sidecar = json.loads((store_home / "runs" / IDS["a"] / "mlflow.json").read_text())
    assert sidecar["synced"][0]["mlflow_run_id"] == synced[IDS["a"]]
    assert sidecar["synced"][0]["tracking_uri"] == tracking_uri


def test_second_sync_does_not_duplicate(synced, tracking_uri, store_home):
    from mlflow import MlflowClient

    t0 = time.perf_counter()
    assert mlflow_sink.sync_all(store_home, tracking_uri) == []
    record = queries.find_run(IDS["b"])
    assert mlflow_sink.log_record(record, tracking_uri) == synced[IDS["b"]]
    # Without the sidecar (say a sync died before writing it), the tag lookup finds the run.
    (record.dir / mlflow_sink.SIDECAR_FILE).unlink()
    assert mlflow_sink.log_record(record, tracking_uri) == synced[IDS["b"]]
    sys.stderr.write(f"\n[mlflow] re-sync checks: {time.perf_counter() - t0:.2f} s\n")
    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name("gpulens")
    assert len(client.search_runs([exp.experiment_id])) == 4


def test_running_record_is_not_synced(tmp_path, tracking_uri):
    w = RunWriter(tmp_path / "runs", kind="train", run_id="live-run")
    try:
        with pytest.raises(UsageError, match="still running"):
            mlflow_sink.log_record(read_record(w.dir), tracking_uri)
        assert mlflow_sink.sync_all(tmp_path, tracking_uri) == []
    finally:
        w.finish()


def test_store_status(synced, store_home, tracking_uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    status = mlflow_sink.store_status(store_home)
    assert status["tracking_uri"] == tracking_uri
    assert status["mlflow_available"] is True
    assert status["mlflow_version"]
    assert status["runs_ended"] == 4 and status["runs_synced"] == 4
    assert status["ok"] is True and status["reachable"] is True


def test_missing_mlflow_names_the_extra(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "mlflow" or name.startswith("mlflow."):
            raise ImportError("No module named 'mlflow'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    record = queries.find_run(IDS["cmd"])
    with pytest.raises(MissingExtraError, match=r"pip install 'gpulens\[store\]'") as info:
        mlflow_sink.log_record(record, f"sqlite:///{tmp_path / 'x.db'}")
    assert info.value.extra == "store"
    with pytest.raises(MissingExtraError):
        mlflow_sink.sync_all(tracking_uri=f"sqlite:///{tmp_path / 'x.db'}")


def test_steps_of_several_ranks_become_one_metric_series_per_rank(tmp_path):
    """A torchrun run's steps (one file, a ``rank`` column): ``steps/rank<R>/...`` metrics, not
    two ranks' points interleaved under one key."""
    from gpulens.record.tracker import RANK_STEPS_SCHEMA

    w = RunWriter(tmp_path / "runs", kind="script", run_id="ranks-run")
    steps = w.series("steps", RANK_STEPS_SCHEMA)
    t0 = time.time()
    for rank in (0, 1):
        for s in range(5):
            row = {"step": s, "time_unix_s": t0 + s, "warmup": False, "samples": 8}
            steps.append({**row, "step_time_s": 0.1 * (rank + 1), "rank": rank})
    w.finish()
    points = mlflow_payload.series_metrics(read_record(w.dir))
    keys = {p[0] for p in points}
    assert "steps/rank0/step_time_s" in keys and "steps/rank1/step_time_s" in keys
    assert "steps/step_time_s" not in keys
    rank1 = [p[1] for p in points if p[0] == "steps/rank1/step_time_s"]
    assert rank1 == [0.2] * 5


def test_mlflow_environment_picks_the_experiment_and_the_users_run(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    dirs = build_store(tmp_path / "home")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team-x")
    in_team = mlflow_sink.log_record(dirs["b"], uri)
    assert client.get_experiment(client.get_run(in_team).info.experiment_id).name == "team-x"

    # Inside a run of the user's: the record goes into it, beside the user's own params.
    exp = client.create_experiment("mine", artifact_location=(tmp_path / "art").as_uri())
    user_run_id = client.create_run(exp, run_name="my-training").info.run_id
    client.log_param(user_run_id, "batch_size", "999")
    monkeypatch.setenv("MLFLOW_RUN_ID", user_run_id)
    assert mlflow_sink.log_record(dirs["a"], uri) == user_run_id
    run = client.get_run(user_run_id)
    assert run.info.status == "RUNNING"  # the user's to end
    assert run.data.params["batch_size"] == "999" and run.data.params["gpulens.batch_size"] == "32"
    assert run.data.metrics["gpulens.throughput_samples_per_s"] == 1000.0
    assert client.get_metric_history(user_run_id, "system/gpu_0_utilization_percentage")
    assert [a.path for a in client.list_artifacts(user_run_id, "gpulens")] == [
        f"gpulens/{IDS['a']}"
    ]
    assert mlflow_sink.log_record(dirs["a"], uri) == user_run_id  # idempotent
    # A second record under the same run becomes its child.
    child = mlflow_sink.log_record(dirs["b"], uri)
    assert child not in (user_run_id, in_team)
    assert client.get_run(child).data.tags["mlflow.parentRunId"] == user_run_id

    monkeypatch.setenv("MLFLOW_RUN_ID", "no-such-run")
    with pytest.raises(UsageError, match="MLFLOW_RUN_ID=no-such-run is not a run"):
        mlflow_sink.log_record(dirs["cmd"], uri)


OPEN_CLIENT = """
import sys
import mlflow
from gpulens.store.availability import open_client
client = open_client(mlflow, sys.argv[1])
print(len(client.search_experiments()))
"""


@pytest.mark.slow
def test_processes_opening_a_fresh_sqlite_store_at_once_all_get_it(tmp_path):
    """Making an MlflowClient creates and migrates a SQLite store; two processes doing it at
    once (the live logger and the end-of-run store of a short run, say) can leave it unusable
    to both (`table _alembic_tmp_tags already exists`). gpulens makes them one at a time."""
    pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPEN_CLIENT, uri],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-1500:]
        assert out.strip() == "1"  # the Default experiment, in one working store


def test_mlflow_telemetry_is_off_unless_the_user_turned_it_on(monkeypatch):
    """MLflow 3.2+ reports usage to its own server from every process that logs a run; a
    measuring tool does not phone home unasked (it cost 4.5 s at a Ctrl-C's end here)."""
    import os

    from gpulens.store import mlflow_sink

    monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
    mlflow_sink.import_mlflow()
    from mlflow.telemetry.utils import is_telemetry_disabled

    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true" and is_telemetry_disabled()
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "false")
    mlflow_sink.import_mlflow()
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "false"  # the user's choice stands
