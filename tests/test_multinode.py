"""Runs over several nodes, on one machine: two `gpulens run --nnodes 2` processes meet on the
loopback (gloo), each writes its shard in its own GPULENS_HOME (two machines) or in one (a
shared filesystem), and the shards join into one run with per-rank series and stragglers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from gpulens.cli import main
from gpulens.errors import UsageError
from gpulens.launch.multinode import NodeTopology, first_host, loopback_alias, resolve_topology
from gpulens.workloads.distributed import free_port

STEPS = 8  # measured steps; warm-up is 4 (on-disk data, no loader workers)
SLOW_MS = 40  # node 1's emulated storage latency per file: its rank waits for data


def _start_nodes(home_of, port: int, extra_of) -> list[subprocess.Popen]:
    procs = []
    for node in (0, 1):
        env = {**os.environ, "GPULENS_HOME": str(home_of(node)), "GPULENS_RANK_WAIT_S": "30"}
        argv = [sys.executable, "-m", "gpulens.cli", "run", "tiny_cnn", "--device", "cpu",
                "--steps", str(STEPS), "--batch-size", "8", "--nnodes", "2", "--node-rank",
                str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                "--no-store", "--json", *extra_of(node)]  # fmt: skip
        procs.append(
            subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )
    return procs


def _docs(procs: list[subprocess.Popen]) -> list[dict]:
    docs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err.decode(errors="replace")[-2000:]
        docs.append(json.loads(out))
    return docs


def test_two_nodes_with_own_homes_join_into_one_run_and_flag_the_slow_rank(tmp_path, capsys):
    from gpulens.data.datagen import make_images

    data = tmp_path / "img"
    make_images(data, 64)
    homes = [tmp_path / "node0", tmp_path / "node1"]
    procs = _start_nodes(
        lambda n: homes[n],
        free_port(),
        lambda n: ["--data", str(data), "--workers", "0",
                   "--storage-latency-ms", str(SLOW_MS if n == 1 else 0)],
    )  # fmt: skip
    shard0, shard1 = _docs(procs)
    run_id = shard0["join"]["run_id"]
    assert shard1["join"]["run_id"] == run_id  # one run id, agreed through the rendezvous
    assert shard0["join"]["joined"] is False and "gpulens runs join" in shard0["join"]["hint"]
    assert [r["rank"] for r in shard0["ranks"]] == [0] and shard0["node_rank"] == 0
    assert [r["rank"] for r in shard1["ranks"]] == [1] and shard1["world_size"] == 2
    dirs = [shard0["record_dir"], shard1["record_dir"]]
    assert Path(dirs[0]).parent == homes[0] / "runs" and Path(dirs[1]).name == f"{run_id}.node1"

    # one shard alone cannot make the run
    assert main(["runs", "join", dirs[0], "--no-store"]) == 2
    assert "node 1's shard is missing" in capsys.readouterr().err

    assert main(["runs", "join", *dirs, "--no-store", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["run_id"], doc["nnodes"], doc["world_size"]) == (run_id, 2, 2)
    assert [(r["rank"], r["node_rank"]) for r in doc["ranks"]] == [(0, 0), (1, 1)]
    assert all(r["hostname"] and r["measured_steps"] == STEPS for r in doc["ranks"])
    assert doc["throughput_samples_per_s"] == pytest.approx(
        shard0["throughput_samples_per_s"] + shard1["throughput_samples_per_s"]
    )
    # node 1 reads each file SLOW_MS later: its rank waits for data, the straggler check sees it
    assert [(s["rank"], s["phase"]) for s in doc["stragglers"]] == [(1, "data_wait")]
    assert doc["straggler_threshold_pct"] == 10.0

    assert main(["runs", "show", run_id, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["status"] == "finished" and "shard" not in shown
    assert {s["name"] for s in shown["series"]} >= {"steps", "host", "host-node1"}
    steps = pq.read_table(Path(shown["record_dir"]) / "series" / "steps.parquet").to_pandas()
    per_rank = steps[~steps["warmup"]].groupby("rank").size().to_dict()
    assert per_rank == {0: STEPS, 1: STEPS}
    slow = steps[~steps["warmup"]].groupby("rank")["data_wait_s"].mean()
    assert slow[1] > slow[0] + 0.5 * 8 * SLOW_MS / 1000
    assert main(["runs", "list", "--json"]) == 0
    assert run_id in [r["run_id"] for r in json.loads(capsys.readouterr().out)["runs"]]
    if _has_plotly():
        out = tmp_path / "report.html"
        assert main(["report", run_id, "-o", str(out), "--json"]) == 0
        assert out.stat().st_size > 0


def _has_plotly() -> bool:
    import importlib.util

    return importlib.util.find_spec("plotly") is not None


def test_two_nodes_on_one_home_join_when_they_end_with_no_straggler(tmp_path, monkeypatch):
    home = tmp_path / "shared"
    shard0, shard1 = _docs(_start_nodes(lambda n: home, free_port(), lambda n: []))
    join = shard0["join"]
    assert join["joined"] is True and shard1["join"] == join  # node 0 told node 1
    meta = json.loads((Path(join["record_dir"]) / "run.json").read_text())
    assert meta["run_id"] == join["run_id"] and meta["status"] == "finished"
    s = meta["summary"]
    assert s["world_size"] == 2 and [r["node_rank"] for r in s["ranks"]] == [0, 1]
    assert s["stragglers"] == []  # equal ranks (synthetic data): no straggler
    assert [n["node_rank"] for n in meta["joined"]["shards"]] == [0, 1]
    from gpulens.store.queries import find_run

    assert find_run("latest", home).run_id == join["run_id"]  # the run, not a shard

    # what node 0's terminal shows after its own summary: the joined run, one row per rank
    from rich.console import Console

    from gpulens.cli import common, nodes

    monkeypatch.setattr(common, "out", Console(width=200, record=True))
    nodes.render_node_end({"join": join})
    text = common.out.export_text()
    assert f"joined run {join['run_id']} (finished): 2 nodes, 2 ranks" in text
    rows = [line.split()[:2] for line in text.splitlines()]
    assert [r for r in rows if r in (["0", "0"], ["1", "1"])] == [["0", "0"], ["1", "1"]]
    assert "no straggler" in text
    nodes.render_node_end(
        {"join": {"joined": False, "run_id": "r", "hint": "gpulens runs join A B"}}
    )
    assert "one node's shard of run r: gpulens runs join A B" in common.out.export_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"], "not in 0..1"),
        (["--nnodes", "2", "--node-rank", "0"], "needs --master-addr"),
        (["--nnodes", "2", "--master-addr", "127.0.0.1"], "needs --node-rank"),
        (["--node-rank", "1"], "needs --nnodes"),
    ],
)
def test_bad_node_options_are_one_usage_line(args, message, capsys):
    code = main(["run", "tiny_cnn", "--device", "cpu", "--steps", "2", "--no-store", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_topology_from_torchrun_and_slurm():
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
                "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "n0",
                "MASTER_PORT": "29400", "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip
    assert resolve_topology(env=torchrun) == NodeTopology(2, 1, "n0", 29400, "torchrun", True)
    with pytest.raises(UsageError, match="--nproc-per-node 1"):
        resolve_topology(env={**torchrun, "LOCAL_WORLD_SIZE": "8"})
    slurm = {"SLURM_STEP_ID": "0", "SLURM_NNODES": "3", "SLURM_NTASKS": "3", "SLURM_NODEID": "2",
             "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_JOB_ID": "123"}  # fmt: skip
    assert resolve_topology(env=slurm) == NodeTopology(3, 2, "gpu07", 20123, "slurm")
    with pytest.raises(UsageError, match="--ntasks-per-node 1"):
        resolve_topology(env={**slurm, "SLURM_NTASKS": "24"})
    # the flags win over the environment; one node is no multi-node run
    assert resolve_topology(1, env=slurm) is None
    assert resolve_topology(env={"SLURM_NNODES": "2"}) is None  # a batch script, not srun
    assert first_host("node1,node2") == "node1" and first_host("a[001-004,9],b") == "a001"
    # a host name that is the loopback on node 0 only (Debian's 127.0.1.1): no binding to it
    assert loopback_alias("node0", "127.0.1.1") and not loopback_alias("127.0.0.1", "127.0.0.1")


def test_nodes_agree_on_node_0s_run_id_and_refuse_different_options(monkeypatch):
    import threading

    from gpulens.launch.multinode import SAME_ON_EVERY_NODE, NodeRendezvous

    monkeypatch.setenv("GPULENS_RENDEZVOUS_TIMEOUT_S", "20")
    port = free_port()
    facts = {name: 1 for name in SAME_ON_EVERY_NODE}

    def meet(steps_of_node_1: int) -> dict:
        nodes = [NodeRendezvous(NodeTopology(2, r, "127.0.0.1", port), 1) for r in (0, 1)]
        got: dict = {}

        def node(r: int) -> None:
            mine = {**facts, "steps": steps_of_node_1 if r else 1, "hostname": f"host{r}"}
            try:
                got[r] = nodes[r].agree(f"id-of-node-{r}", mine)
            except UsageError as exc:
                got[r] = str(exc)

        threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert nodes[1].hostnames() in ({}, {0: "host0", 1: "host1"})
        return got

    assert meet(1) == {0: "id-of-node-0", 1: "id-of-node-0"}
    port = free_port()  # a fresh store, as the next run of a launcher would get
    refused = meet(5)
    assert all("node 1 runs steps=5 but node 0 steps=1" in refused[r] for r in (0, 1))


def test_stalls_takes_the_same_node_options(tmp_path, capsys):
    code = main(["stalls", "tiny_cnn", "--data", str(tmp_path), "--device", "cpu", "--nnodes",
                 "2", "--node-rank", "0", "--no-store"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "--nnodes 2 needs --master-addr" in err and "Traceback" not in err


def test_the_joined_runs_throughput_interval_is_low_high_as_every_runs():
    """A joined run's `throughput_ci95_samples_per_s` was one number (the half-width in
    samples/s, 205.4), where every other run and the README give `[low, high]`."""
    from types import SimpleNamespace

    from gpulens.record.join import SHARD_KEY, joined_summary

    def shard(node: int) -> SimpleNamespace:
        meta = {
            SHARD_KEY: {"node_rank": node, "hostname": "h", "ranks": [node], "run_id": "r",
                        "nnodes": 2},
            "summary": {"batch_size": 8, "measured_steps": 10, "throughput_ci95_pct": 20.0,
                        "throughput_samples_per_s": 500.0},
            "effective_config": {"backend": "gloo"},
        }  # fmt: skip
        return SimpleNamespace(meta=meta, run_id=f"r.node{node}", status="finished", dir=Path())

    summary = joined_summary({0: shard(0), 1: shard(1)})
    assert summary["throughput_samples_per_s"] == 1000.0
    low, high = summary["throughput_ci95_samples_per_s"]
    assert 0 < low < 1000.0 < high


@pytest.mark.parametrize("node", [0, 1])
def test_a_node_alone_says_whom_it_waits_for_and_gives_up_in_its_time(tmp_path, node):
    """A node whose partner never comes (a mistyped --master-port) printed nothing for the
    whole timeout (600 s: node 1 took twice that, then dumped c10d's C++ stack frames); it
    now says after a few seconds whom it waits for, and ends with one line at the timeout."""
    timeout_s = 8
    env = {**os.environ, "GPULENS_HOME": str(tmp_path), "GPULENS_RENDEZVOUS_TIMEOUT_S": "8"}
    argv = [sys.executable, "-m", "gpulens.cli", "run", "tiny_cnn", "--device", "cpu",
            "--steps", "2", "--nnodes", "2", "--node-rank", str(node), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), "--no-store"]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    took_s = time.monotonic() - t0
    other = 1 - node
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"node {node}: waiting for node {other} at 127.0.0.1:" in proc.stderr
    assert "frame #" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert took_s < timeout_s + 15  # start-up, then the timeout once (not twice)


def test_a_shard_says_once_where_it_lies_and_how_to_join(tmp_path):
    """Each node printed its shard's join hint twice: a logged warning on stderr, then the
    same under its summary. Once now: under the summary, or with --json on stderr (the
    document holds it as join.hint)."""
    procs = []
    port = free_port()
    for node in (0, 1):  # node 0 as a person reads it, node 1 with --json
        env = {**os.environ, "GPULENS_HOME": str(tmp_path / f"node{node}"),
               "GPULENS_RANK_WAIT_S": "30"}  # fmt: skip
        argv = [sys.executable, "-m", "gpulens.cli", "run", "tiny_cnn", "--device", "cpu",
                "--steps", "2", "--batch-size", "8", "--gpus", "1", "--nnodes", "2",
                "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port",
                str(port), "--no-store", *(["--json"] if node else [])]  # fmt: skip
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    (out0, err0), (out1, err1) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [0, 0], (err0[-2000:], err1[-2000:])
    hint = "gpulens runs join"
    assert (out0 + err0).count(hint) == 1 and hint in out0, (out0, err0)
    assert err1.count(hint) == 1 and hint in json.loads(out1)["join"]["hint"], err1
