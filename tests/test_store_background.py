"""Every run reaches the store on its own, and the store never holds a run: an unreachable
server is found in a couple of seconds, logging runs in the background with a bounded wait,
several processes can create a new SQLite store at once, and `store_status` tells the truth."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from gpulens.record.writer import RunWriter
from gpulens.store import background, mlflow_sink
from gpulens.store.availability import (
    StoreUnavailableError,
    check_store,
    display_uri,
    mlflow_http_limits,
)

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")
REPO = Path(__file__).resolve().parents[1]
DEAD_URI = "http://127.0.0.1:1"  # nothing listens on port 1


def _record(runs: Path, status: str = "finished", name: str = "r") -> Path:
    w = RunWriter(runs, kind="script", name=name, requested_config={"argv": ["x.py"]})
    w.update(summary={"throughput_samples_per_s": 10.0, "phases_s": {"step": 0.1}})
    w.finish(status, error=None if status == "finished" else f"{status} on purpose")
    return w.dir


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "GPULENS_"))}
    env.update(GPULENS_HOME=str(home), PYTHONPATH=str(REPO / "src"), **extra)
    return env


class _Handler(http.server.BaseHTTPRequestHandler):
    """/health answers ``code``; every other path hangs ``hang_s`` (a server that is up but
    does not get to the API)."""

    code = 200
    hang_s = 0.0

    def do_GET(self):  # noqa: N802 - the http.server API
        if not self.path.startswith("/health"):
            time.sleep(self.hang_s)
        self.send_response(self.code if self.path.startswith("/health") else 500)
        self.end_headers()
        self.wfile.write(b"OK")

    do_POST = do_GET  # noqa: N815

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    """A local HTTP server; yields a function (code, hang_s) -> its URI."""
    servers = []

    def start(code: int = 200, hang_s: float = 0.0) -> str:
        handler = type("H", (_Handler,), {"code": code, "hang_s": hang_s})
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


# ----------------------------------------------------------------------------- reachability
def test_check_store_tells_each_kind_of_store_apart(tmp_path, server):
    dead = check_store(DEAD_URI)
    assert (dead.reachable, dead.ok) == (False, False)
    assert dead.detail == "unreachable: connection refused"
    assert check_store(server(200)).ok
    refused = check_store(server(401))
    assert refused.reachable and not refused.ok and "MLFLOW_TRACKING_TOKEN" in refused.detail
    other = check_store(server(404))  # some web server, or a proxy, but not MLflow
    assert other.reachable and not other.ok and "not as an MLflow tracking server" in other.detail
    fresh = check_store(f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}")
    assert fresh.ok and "created at first use" in fresh.detail
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if not os.access(ro, os.W_OK):  # root can write anywhere
            assert not check_store(f"sqlite:///{ro / 'mlflow.db'}").ok
    finally:
        ro.chmod(0o700)
    assert check_store("postgresql://u:p@127.0.0.1:1/db").reachable is False
    assert check_store("databricks").reachable is None
    assert display_uri("http://me:secret@host:5000/x") == "http://me:***@host:5000/x"


def test_a_server_that_accepts_but_never_answers_is_unreachable_within_the_timeout():
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # accepts the connection, never answers
    try:
        t0 = time.monotonic()
        found = check_store(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=0.5)
        assert time.monotonic() - t0 < 3.0
        assert found.reachable is False and "no answer within 0.5 s" in found.detail
    finally:
        listener.close()


def test_unreachable_server_fails_in_seconds_not_minutes(tmp_path):
    """Before: MLflow's own retries held `log_record` about 4 minutes."""
    record = _record(tmp_path / "runs")
    code = f"from gpulens.store.mlflow_sink import log_record; log_record({str(record)!r})"
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-c", code],
        env=_env(tmp_path, MLFLOW_TRACKING_URI=DEAD_URI),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.monotonic() - t0 < 30
    assert p.returncode == 1
    assert "StoreUnavailableError: MLflow store http://127.0.0.1:1: unreachable" in p.stderr
    assert "gpulens runs sync" in p.stderr


def test_sync_all_stops_at_once_for_an_unreachable_store(tmp_path, monkeypatch):
    for i in range(3):
        _record(tmp_path / "runs", name=f"r{i}")
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="connection refused"):
        mlflow_sink.sync_all(tmp_path, DEAD_URI)
    assert time.monotonic() - t0 < 10


def test_store_status_says_whether_the_store_answers(tmp_path, monkeypatch):
    _record(tmp_path / "runs")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", DEAD_URI)
    status = mlflow_sink.store_status(tmp_path)
    assert status["mlflow_available"] is True
    assert status["ok"] is False and status["reachable"] is False
    assert status["detail"] == "unreachable: connection refused"
    assert "gpulens runs sync" in status["hint"]
    assert status["runs_unsynced"] == 1
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    status = mlflow_sink.store_status(tmp_path)
    assert status["ok"] is True and status["tracking_uri"].startswith("sqlite:///")
    assert mlflow_sink.store_status(tmp_path, check=False)["reachable"] is None


def test_mlflow_http_limits_keep_what_the_user_set(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "99")
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    with mlflow_http_limits(), mlflow_http_limits():
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "1"
        assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "99"
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "99"


# ----------------------------------------------------------------------------- log_finished
def test_log_finished_logs_failed_and_killed_runs_with_their_status(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    statuses = {}
    for status in ("finished", "failed", "killed"):
        out = background.log_finished(_record(tmp_path / "runs", status), tracking_uri=uri)
        assert out.status == "logged", out.message
        statuses[status] = MlflowClient(uri).get_run(out.mlflow_run_id).info.status
    assert statuses == {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}


def test_log_finished_never_raises_and_skips_without_mlflow(tmp_path, monkeypatch):
    out = background.log_finished(tmp_path / "no-such-run", tracking_uri=DEAD_URI)
    assert out.status in ("failed", "unavailable")  # a message, not an exception
    record = _record(tmp_path / "runs")
    monkeypatch.setattr(mlflow_sink, "is_available", lambda: False)
    out = background.log_finished(record)
    assert out.status == "skipped" and "gpulens[store]" in out.message
    monkeypatch.undo()
    monkeypatch.setenv("GPULENS_STORE", "0")
    assert background.log_finished(record).status == "skipped"


def test_log_finished_for_an_unreachable_store_returns_in_seconds(tmp_path):
    record = _record(tmp_path / "runs")
    t0 = time.monotonic()
    out = background.log_finished(record, tracking_uri=DEAD_URI, budget_s=30)
    assert time.monotonic() - t0 < 10
    assert out.status == "unavailable" and "gpulens runs sync" in out.message


def test_log_finished_never_waits_past_its_budget(tmp_path, server):
    """A server that answers /health but hangs on the API: the caller is back after the
    budget, told that `runs sync` will log the run."""
    pytest.importorskip("mlflow")
    uri = server(200, hang_s=20.0)
    record = _record(tmp_path / "runs")
    t0 = time.monotonic()
    out = background.log_finished(record, tracking_uri=uri, budget_s=1.0)
    assert time.monotonic() - t0 < 5
    assert out.status == "pending" and "gpulens runs sync" in out.message


def test_log_finished_in_the_background_returns_at_once(tmp_path):
    pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    record = _record(tmp_path / "runs")
    t0 = time.monotonic()
    out = background.log_finished(record, block=False, tracking_uri=uri, budget_s=60)
    assert out.status == "pending" and time.monotonic() - t0 < 1.0
    (done,) = [o for o in background.wait_pending() if o.record_dir == str(record)]
    assert done.status == "logged", done.message
    assert mlflow_sink.synced_run_id(
        mlflow_sink.read_record(record), uri, mlflow_sink.DEFAULT_EXPERIMENT
    )


# ----------------------------------------------------------------------------- concurrency
def test_four_processes_create_and_log_into_a_new_store_at_once(tmp_path):
    """Before: one of four reached MLflow; the others died in the schema migration."""
    pytest.importorskip("mlflow")
    records = [_record(tmp_path / "runs", name=f"r{i}") for i in range(4)]
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    code = "import sys; from gpulens.store.mlflow_sink import log_record; log_record(sys.argv[1])"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r)],
            env=_env(tmp_path, MLFLOW_TRACKING_URI=uri),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in records
    ]
    errors = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], errors
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("gpulens")
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["r0", "r1", "r2", "r3"]


# ----------------------------------------------------------------------------- on their own
TRACKED = textwrap.dedent(
    """
    import time, gpulens
    with gpulens.track(name="standalone", warmup_steps=1) as tracker:
        for batch in tracker.data([list(range(8))] * 6):
            time.sleep(0.005)
    print("training done", flush=True)
    """
)


def test_a_tracked_script_on_its_own_reaches_the_store(tmp_path):
    """Before: a `gpulens.track()` script reached MLflow only through `gpulens runs sync`."""
    pytest.importorskip("mlflow")
    script = tmp_path / "train.py"
    script.write_text(TRACKED)
    home = tmp_path / "home"
    env = _env(home, GPULENS_STORE_WAIT_S="300")  # a fresh store on a loaded machine: no race
    p = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=360
    )
    assert p.returncode == 0, p.stderr
    (record,) = mlflow_sink.list_records(home / "runs")
    uri = f"sqlite:///{(home / 'mlflow.db').resolve()}"
    assert mlflow_sink.synced_run_id(record, uri, mlflow_sink.DEFAULT_EXPERIMENT)


def test_a_tracked_script_with_an_unreachable_store_ends_in_seconds(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRACKED)
    home = tmp_path / "home"
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, str(script)],
        env=_env(home, MLFLOW_TRACKING_URI=DEAD_URI),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert time.monotonic() - t0 < 60  # startup and the 2 s check, not minutes of retries
    assert p.returncode == 0, p.stderr
    assert "training done" in p.stdout
    assert "unreachable: connection refused" in p.stderr and "gpulens runs sync" in p.stderr
    (record,) = mlflow_sink.list_records(home / "runs")
    assert record.status == "finished"


def test_gpulens_run_with_an_unreachable_store_ends_in_seconds(tmp_path):
    """Before: 253.5 s for a 6 s run."""
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "gpulens.cli", "run", "--", sys.executable, "-c", "pass"],
        env=_env(tmp_path / "home", MLFLOW_TRACKING_URI=DEAD_URI),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert time.monotonic() - t0 < 60
    assert p.returncode == 0, p.stderr
    assert "unreachable" in p.stderr and "runs sync" in p.stderr
