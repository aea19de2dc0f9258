"""A team store with real components on loopback: PostgreSQL (Debian's ``postgresql``) behind
``mlflow server``, two ``gpulens run`` processes logging to it at once, then
``gpulens runs list --store`` and the dashboard's store listing reading both back."""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("mlflow", reason="the team store needs the [store] extra (in [dev])")
pytest.importorskip("psycopg2", reason="PostgreSQL needs psycopg2-binary (the [team] extra)")

pytestmark = pytest.mark.slow
GPULENS = [sys.executable, "-m", "gpulens.cli"]


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=os.path.getmtime)
    return versions[-1] if versions else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _as_user() -> list[str]:
    """Postgres refuses to run as root: run it as ``nobody`` then."""
    if os.geteuid() != 0:
        return []
    runuser = shutil.which("runuser") or shutil.which("setpriv")
    if runuser is None:
        pytest.skip("running as root without runuser/setpriv: cannot start PostgreSQL")
    if runuser.endswith("runuser"):
        return [runuser, "-u", "nobody", "--"]
    pw = pwd.getpwnam("nobody")
    return [runuser, f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups"]


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


@pytest.fixture(scope="module")
def team_store(tmp_path_factory):
    """``http://127.0.0.1:PORT`` of an MLflow server on a fresh PostgreSQL database."""
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("PostgreSQL is not installed: apt-get install postgresql (see .ci/run)")
    root = tmp_path_factory.mktemp("team")
    # pytest's tmp folders are private to root: the postgres user needs a folder of its own
    pg_dir = Path(tempfile.mkdtemp(prefix="gpulens-pg-"))
    user = _as_user()
    if user:
        os.chmod(pg_dir, 0o700)
        shutil.chown(pg_dir, "nobody")
    data = pg_dir / "data"
    subprocess.run([*user, initdb, "-D", str(data), "-A", "trust", "-U", "gpulens",
                    "--no-sync", "-E", "UTF8"], check=True, capture_output=True)  # fmt: skip
    pg_port = _free_port()
    options = f"-p {pg_port} -k {pg_dir} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run([*user, pg_ctl, "-D", str(data), "-l", str(pg_dir / "log"), "-w", "-o",
                    options, "start"], check=True, capture_output=True)  # fmt: skip
    server = None
    try:
        subprocess.run([*user, _pg_bin("createdb") or "createdb", "-h", "127.0.0.1", "-p",
                        str(pg_port), "-U", "gpulens", "mlflow"], check=True)  # fmt: skip
        port = _free_port()
        artifacts = root / "artifacts"
        log = open(root / "mlflow.log", "w")  # noqa: SIM115 - kept open for the server's life
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
             f"postgresql+psycopg2://gpulens@127.0.0.1:{pg_port}/mlflow",
             "--artifacts-destination", str(artifacts), "--host", "127.0.0.1",
             "--port", str(port), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        _wait_http(url + "/health", server, 60)
        yield {"url": url, "artifacts": artifacts}
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
        subprocess.run([*user, pg_ctl, "-D", str(data), "-m", "fast", "stop"],
                       capture_output=True)  # fmt: skip
        shutil.rmtree(pg_dir, ignore_errors=True)


def _env(home: Path, url: str) -> dict[str, str]:
    env = {**os.environ, "GPULENS_HOME": str(home), "MLFLOW_TRACKING_URI": url}
    env.pop("GPULENS_STORE", None)
    env.pop("MLFLOW_RUN_ID", None)
    return env


def test_two_processes_log_to_postgres_and_both_read_back(team_store, tmp_path):
    url = team_store["url"]
    # two "machines" (homes) logging at the same time
    procs = [
        subprocess.Popen(
            [
                *GPULENS,
                "run",
                "tiny_cnn",
                "--device",
                "cpu",
                "--steps",
                "3",
                "--batch-size",
                "2",
                "--json",
            ],
            env=_env(tmp_path / f"node{i}", url),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    run_ids = []
    for proc, (stdout, stderr) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, stderr
        run_ids.append(json.loads(stdout)["run_id"])  # stdout is one JSON document, no MLflow
    # each record says where it went
    mlflow_ids = {}
    for i, run_id in enumerate(run_ids):
        side = json.loads((tmp_path / f"node{i}" / "runs" / run_id / "mlflow.json").read_text())
        (entry,) = side["synced"]
        assert entry["tracking_uri"] == url
        mlflow_ids[run_id] = entry["mlflow_run_id"]

    # a third machine, with no records of its own, lists both from the store
    listed = subprocess.run(
        [*GPULENS, "runs", "list", "--store", "--json"], env=_env(tmp_path / "other", url),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    rows = {r["run_id"]: r for r in json.loads(listed.stdout)["runs"]}
    assert set(run_ids) <= set(rows)
    for run_id in run_ids:
        row = rows[run_id]
        assert row["mlflow_run_id"] == mlflow_ids[run_id]
        assert row["status"] == "finished" and row["synced"]
        assert row["metrics"], "the summary metrics reached PostgreSQL"

    # nothing lost: series points and the record's artifacts of both runs
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=url)
    for run_id, mlflow_id in mlflow_ids.items():
        run = client.get_run(mlflow_id)
        step_keys = [k for k in run.data.metrics if k.startswith("steps/")]
        assert step_keys, f"{run_id}: no step series in the store"
        history = client.get_metric_history(mlflow_id, step_keys[0])
        assert len(history) >= 1
        names = {Path(a.path).name for a in client.list_artifacts(mlflow_id, "record")}
        assert "run.json" in names, names
        stored = team_store["artifacts"].rglob(f"{mlflow_id}/artifacts/record/run.json")
        assert json.loads(next(stored).read_text())["run_id"] == run_id

    # the dashboard lists both from the store
    from gpulens.web.server import make_server

    os.environ["MLFLOW_TRACKING_URI"] = url
    try:
        server, page = make_server("127.0.0.1", 0, home=tmp_path / "other")
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            with urllib.request.urlopen(page.rstrip("/") + "/api/store-runs", timeout=30) as r:
                doc = json.loads(r.read())
            with urllib.request.urlopen(page.rstrip("/") + "/store", timeout=30) as r:
                store_html = r.read().decode()
        finally:
            server.shutdown()
            server.server_close()
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    assert set(run_ids) <= {r["run_id"] for r in doc["runs"]}
    assert all(run_id in store_html for run_id in run_ids)  # the dashboard's store page


def test_store_listing_of_a_missing_experiment_is_one_line(team_store, tmp_path):
    env = {**_env(tmp_path, team_store["url"]), "MLFLOW_EXPERIMENT_NAME": "nobody-logged-here"}
    listed = subprocess.run(
        [*GPULENS, "runs", "list", "--store", "--json"], env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 2
    error = json.loads(listed.stdout)["error"]  # --json: the error is the one document
    assert error["type"] == "usage_error" and "nobody-logged-here" in error["message"]
    assert "Traceback" not in listed.stderr
