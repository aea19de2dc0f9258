"""Live MLflow logging: a running record's series reach MLflow in windows while it runs, and the
end-of-run logging completes that same MLflow run (no second run, no point twice)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulens.record import schema
from gpulens.record.reader import read_record
from gpulens.store import mlflow_sink
from gpulens.store.availability import store_lock

mlflow = pytest.importorskip("mlflow")
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")

FIXTURE = Path(__file__).parent / "fixtures" / "record_h100_resnet50_jpeg"
GPU_UTIL = "system/gpu_0_utilization_percentage"


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def running_copy(tmp_path: Path) -> Path:
    """The real H100 record as it looked while it ran."""
    run_dir = tmp_path / "runs" / FIXTURE.name
    shutil.copytree(FIXTURE, run_dir)
    meta = json.loads((run_dir / schema.RUN_FILE).read_text())
    meta["status"] = schema.STATUS_RUNNING
    (run_dir / schema.RUN_FILE).write_text(json.dumps(meta))
    return run_dir


def end(run_dir: Path) -> None:
    meta = json.loads((run_dir / schema.RUN_FILE).read_text())
    meta["status"] = schema.STATUS_FINISHED
    (run_dir / schema.RUN_FILE).write_text(json.dumps(meta))


def history(client, run_id: str, key: str) -> list[int]:
    return sorted(m.timestamp for m in client.get_metric_history(run_id, key))


def test_live_windows_then_the_end_fill_one_run_without_repeats(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run_dir = running_copy(tmp_path)
    gpu = read_record(run_dir).series("gpu")
    mid_s = float(gpu["time_unix_s"].quantile(0.5))

    first = mlflow_sink.log_live(read_record(run_dir), uri, "gpulens", mid_s, max_points=20)
    run = client.get_run(first)
    assert run.info.status == "RUNNING" and run.data.tags["gpulens.live"] == "true"
    live_points = history(client, first, GPU_UTIL)
    assert 0 < len(live_points) <= 20 and max(live_points) <= mid_s * 1000
    assert not run.data.params  # params and summary come when the run has ended

    end(run_dir)
    final = mlflow_sink.log_record(run_dir, uri, "gpulens")
    assert final == first  # completed, not a second run
    runs = client.search_runs([run.info.experiment_id])
    assert len(runs) == 1
    run = client.get_run(final)
    assert run.info.status == "FINISHED" and run.data.tags["gpulens.synced"] == "true"
    assert run.data.metrics["throughput_samples_per_s"] == pytest.approx(2662.7456713163683)
    points = history(client, final, GPU_UTIL)
    assert len(points) == len(set(points)) > len(live_points)  # the rest came, none twice
    assert points[: len(live_points)] == live_points
    assert min(points[len(live_points) :]) > mid_s * 1000
    assert mlflow_sink.log_record(run_dir, uri, "gpulens") == first  # idempotent


def test_live_points_go_into_the_users_run(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("mine", artifact_location=(tmp_path / "art").as_uri())
    user_run_id = client.create_run(exp, run_name="my-training").info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", user_run_id)
    run_dir = running_copy(tmp_path)
    assert mlflow_sink.log_live(read_record(run_dir), uri, "gpulens", None, 10) == user_run_id
    assert history(client, user_run_id, GPU_UTIL)
    end(run_dir)
    assert mlflow_sink.log_record(run_dir, uri) == user_run_id
    run = client.get_run(user_run_id)
    assert run.info.status == "RUNNING"  # still the user's to end
    assert run.data.params["gpulens.batch_size"] == str(
        read_record(run_dir).meta["effective_config"]["batch_size"]
    )
    assert len(client.search_runs([exp])) == 1


@pytest.mark.slow
def test_a_cpu_run_appears_in_mlflow_while_it_runs(tmp_path):
    home = tmp_path / "home"
    env = {**os.environ, "GPULENS_HOME": str(home), "GPULENS_MLFLOW_LIVE_S": "2"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpulens.cli", "run", "tiny_cnn", "--device", "cpu",
         "--duration", "15", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    uri = f"sqlite:///{home / 'mlflow.db'}"
    seen = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and seen is None:
            time.sleep(1.0)
            if not (home / "mlflow.db").exists():
                continue
            # under gpulens's own store lock: a process that opens a fresh SQLite store while
            # gpulens creates it races MLflow's schema migration, which can leave the store
            # unusable to both (`table _alembic_tmp_tags already exists`)
            with store_lock(uri):
                client = mlflow.MlflowClient(uri)
                runs = client.search_runs(
                    [e.experiment_id for e in client.search_experiments()],
                    filter_string="tags.`gpulens.live` = 'true'",
                )
                running = [r for r in runs if r.info.status == "RUNNING"]
                if running and client.get_metric_history(
                    running[0].info.run_id, "system/cpu_utilization_percentage"
                ):
                    seen = running[0].info.run_id
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-1500:]
    assert seen, f"no live MLflow run with system metrics while the run ran: {err[-1500:]}"
    doc = json.loads(out)
    client = mlflow.MlflowClient(uri)
    run = client.get_run(seen)
    assert run.info.status == "FINISHED" and run.data.tags["gpulens.run_id"] == doc["run_id"]
    assert len(client.search_runs([run.info.experiment_id])) == 1


USER_SCRIPT = """
import sys
import mlflow
import torch
from torch.utils.data import DataLoader, TensorDataset

mlflow.set_experiment("mine")
with mlflow.start_run(run_name="users-run") as run:
    mlflow.log_param("lr", 0.1)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(torch.randn(512, 8), torch.randint(0, 2, (512,))), 16)
    tracker = None
    if sys.argv[1] == "tracked":
        import gpulens
        tracker = gpulens.track(name="tracked")
        data = tracker.data(data)
    for _epoch in range(2):
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    if tracker is not None:
        tracker.close()
    open(sys.argv[-1], "w").write(run.info.run_id)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["tracked", "injected"])
def test_a_script_with_its_own_mlflow_run_gets_the_record_in_it(tmp_path, how):
    """The script starts an MLflow run itself; gpulens's record is logged into that run (the
    tracker notes it while it is active), not as a run beside it."""
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "GPULENS_HOME": str(tmp_path / "home"), "MLFLOW_TRACKING_URI": uri,
           "GPULENS_MLFLOW_LIVE_S": "0"}  # fmt: skip
    out = tmp_path / "user_run_id"
    if how == "tracked":
        argv = [sys.executable, str(script), "tracked", str(out)]
    else:
        argv = [sys.executable, "-m", "gpulens.cli", "run", "--",
                sys.executable, str(script), "plain", str(out)]  # fmt: skip
    # cwd: MLflow puts a new experiment's artifacts under ./mlruns
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    user_run_id = out.read_text()
    client = mlflow.MlflowClient(uri)
    run = client.get_run(user_run_id)
    assert run.data.params["lr"] == "0.1" and "gpulens.run_id" in run.data.tags
    assert run.data.metrics["gpulens.measured_steps"] > 0
    assert client.get_metric_history(user_run_id, "system/cpu_utilization_percentage")
    everything = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in everything] == [user_run_id]


def _follow_until_live(tmp_path, client, uri, writers) -> list:
    """Follow this process's records until each has been logged live, discard them all, and
    let the follower make its last pass; the live MLflow runs of their own they had."""
    import os
    import threading

    from gpulens.store.live import follow

    stop = threading.Event()
    thread = threading.Thread(
        target=follow, args=(tmp_path / "runs", os.getpid(), time.time() - 1, 0.2, stop)
    )
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and thread.is_alive():
            if all((w.dir / mlflow_sink.SIDECAR_FILE).exists() for w in writers):
                break  # each logged live
            time.sleep(0.2)
        with store_lock(uri):
            live = client.search_runs(
                [e.experiment_id for e in client.search_experiments()],
                filter_string="tags.`gpulens.live` = 'true'",
            )
        assert live and {r.info.status for r in live} == {"RUNNING"}
        assert all(w.discard() for w in writers)
    finally:
        stop.set()
        thread.join(timeout=60)
    return live


def test_a_discarded_record_leaves_no_live_run_running(tmp_path, monkeypatch):
    """A run refused before it measured anything removes its record (RunWriter.discard), but
    the live MLflow run the follower had started for it stayed RUNNING for ever. The follower
    now ends (FAILED) and deletes it; a user's run (MLFLOW_RUN_ID) is left as it was, both
    the parent of a live run and the run a plain record logs its points into."""
    from gpulens.record.writer import RunWriter

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = mlflow.MlflowClient(uri)
    runs = tmp_path / "runs"
    (live,) = _follow_until_live(tmp_path, client, uri, [RunWriter(runs, kind="train")])
    run = client.get_run(live.info.run_id)
    assert run.info.status == "FAILED" and run.info.lifecycle_stage == "deleted"

    exp = client.create_experiment("mine", artifact_location=(tmp_path / "art").as_uri())
    user_run_id = client.create_run(exp, run_name="my-training").info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", user_run_id)
    child = RunWriter(runs, kind="train", role="stalls:cached")  # a child run of the user's
    plain = RunWriter(runs, kind="train")  # its points go into the user's run
    (live,) = _follow_until_live(tmp_path, client, uri, [child, plain])
    run = client.get_run(live.info.run_id)
    assert run.data.tags["gpulens.run_id"] == child.run_id
    assert run.info.status == "FAILED" and run.info.lifecycle_stage == "deleted"
    user_run = client.get_run(user_run_id)
    assert user_run.info.status == "RUNNING" and user_run.info.lifecycle_stage == "active"
