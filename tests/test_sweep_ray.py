"""The Ray executor on a local Ray cluster: a 4-cell CPU sweep with one failing cell (a usage
error, not retried) recorded, killed midway (SIGKILL of the driver) and resumed: only unfinished
cells run again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install 'gpulens[sweep]')")

SPEC = """name: ray-cpu
command: run
workload: tiny_cnn
grid: {batch_size: [0, 2, 3, 4]}
options: {steps: 2, device: cpu, no_store: true}
"""


def _states(sweep_dir):
    out = {}
    for path in (sweep_dir / "cells").glob("*.json"):
        doc = json.loads(path.read_text())
        out[doc["config"]["batch_size"]] = doc
    return out


def test_ray_sweep_records_a_failure_and_resumes_after_a_kill(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "gpulens.cli", "sweep", str(spec), "--executor", "ray"]
    cmd += ["--out", str(sweep_dir), "--retries", "1", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # SIGKILL the driver once two cells are done
        states = _states(sweep_dir) if (sweep_dir / "cells").exists() else {}
        if sum(s["status"] == "done" for s in states.values()) >= 2:
            break
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = {b: s["run_id"] for b, s in _states(sweep_dir).items() if s["status"] == "done"}
    assert 2 <= len(done_before) < 4

    res = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=240)
    assert res.returncode == 1, res.stderr[-2000:]  # the failing cell makes the sweep exit 1
    doc = json.loads(res.stdout)
    assert (doc["done"], doc["failed"], doc["remaining"]) == (3, 1, 0)
    by_batch = {c["config"]["batch_size"]: c for c in doc["cells"]}
    for batch, run_id in done_before.items():  # finished before the kill: not run again
        assert by_batch[batch]["run_id"] == run_id and by_batch[batch]["attempts"] == 1
    failed = by_batch[0]
    assert failed["status"] == "failed" and failed["exit_code"] == 2  # a usage error: recorded
    assert doc["usage_errors"] == 1
    assert "batch-size" in failed["error"]
    for batch in (2, 3, 4):
        assert by_batch[batch]["status"] == "done" and by_batch[batch]["run_id"]


def test_a_cell_without_a_gpu_takes_the_smallest_nodes_cpus():
    from gpulens.sweep.ray_executor import smallest_node_cpus

    nodes = [
        {"Alive": True, "Resources": {"CPU": 16.0, "GPU": 2.0}},
        {"Alive": True, "Resources": {"CPU": 8.0}},
        {"Alive": False, "Resources": {"CPU": 2.0}},  # a dead node does not count
        {"Alive": True, "Resources": {}},  # a node with no CPU resource (a GPU-only label)
    ]
    assert smallest_node_cpus(nodes) == 8.0
    assert smallest_node_cpus([]) == 1


def test_a_ray_address_where_nothing_listens_fails_in_seconds_with_one_line(monkeypatch):
    """`--ray-address 127.0.0.1:1` hung the sweep for over ten minutes in Ray's connect
    retries; `--ray-address auto` with no cluster printed "internal error: ConnectionError"."""
    import socket

    import ray

    from gpulens.errors import RuntimeFailure
    from gpulens.sweep.ray_executor import RayExecutor

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(RuntimeFailure, match="no Ray cluster answers at .*ray start --head"):
            RayExecutor(address=address)
    assert time.monotonic() - t0 < 10

    def no_cluster(**_):
        raise ConnectionError("Could not find any running Ray instance. Please specify one.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    with pytest.raises(RuntimeFailure, match="Could not find any running Ray instance\\)"):
        RayExecutor(address="auto").run([], lambda c: None, lambda c, r: False)
