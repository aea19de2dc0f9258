"""Data-parallel runs (on the CPU over gloo: the same code path as NCCL on GPUs), the NCCL
transport read-back, the multi-GPU breakdown arithmetic and the ring all-reduce model."""

from __future__ import annotations

import json

import pytest

from gpulens.cli import main
from gpulens.errors import UsageError
from gpulens.predict.allreduce import RingModel, calibrate_scaling, ddp_buckets, fit_ring_model
from gpulens.record.reader import read_record, read_series_table
from gpulens.stalls import Measured, breakdown, recommend
from gpulens.workloads.config import TrainConfig
from gpulens.workloads.distributed import parse_nccl_transports, transport_env
from gpulens.workloads.recipe import EndlessShuffle
from gpulens.workloads.train import run_training

# Lines as NCCL 2.2x writes them with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT.
NCCL_P2P_LOG = """\
host:1234:1250 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
host:1234:1250 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
host:1234:1250 [0] NCCL INFO Connected all rings, use ring PXN 0 GDR 1
"""
NCCL_SOCKET_LOG = """\
host:1234:1250 [0] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [receive] via NET/Socket/0
host:1234:1250 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0
"""


def test_nccl_transports_are_read_from_its_log():
    assert parse_nccl_transports(NCCL_P2P_LOG) == ["P2P/CUMEM"]
    assert parse_nccl_transports(NCCL_SOCKET_LOG) == ["NET/Socket"]
    assert parse_nccl_transports("no channels here") == []
    env = transport_env("socket")
    assert env["NCCL_P2P_DISABLE"] == "1" and env["NCCL_SHM_DISABLE"] == "1"
    assert transport_env("default") == {}


def test_ranks_read_disjoint_shards_of_one_permutation():
    shards = []
    for rank in range(3):
        it = iter(EndlessShuffle(30, seed=1, rank=rank, world_size=3))
        shards.append({next(it) for _ in range(10)})
    assert set.union(*shards) == set(range(30))
    assert sum(len(s) for s in shards) == 30


def test_two_process_run_agrees_on_steps_and_counts_all_samples(tmp_path):
    r = run_training(
        TrainConfig(workload="tiny_cnn", gpus=2, device="cpu", duration_s=1.5, batch_size=8),
        tmp_path,
    )
    s = r.summary
    assert s["processes"] == 2 and s["global_batch_size"] == 16
    assert s["stop_reason"] == "duration"
    # rank 0 decides, all ranks stop together at a multiple of the agreement interval
    assert s["measured_steps"] % 10 == 0
    assert s["throughput_samples_per_s"] == pytest.approx(
        16 * s["measured_steps"] / s["measured_wall_s"]
    )
    record = read_record(r.record_dir)
    assert record.status == "finished"
    eff = record.meta["effective_config"]
    assert eff["transport_effective"] == ["gloo"]
    # What rank 0 built reaches the parent's record (it used to stay None in the rank).
    assert eff["optimizer"] == "SGD"
    assert eff["dataset"]["kind"] == "synthetic_on_device"
    assert (eff["backend"], eff["device"], eff["rendezvous_addr"]) == ("gloo", "cpu", "127.0.0.1")
    # every rank's steps, each row with the rank's own batch (tests/test_host_ranks.py)
    steps = read_series_table(r.record_dir / "series" / "steps").to_pandas()
    assert steps.groupby("rank").size().to_dict() == {
        0: s["measured_steps"] + s["warmup_steps"],
        1: s["measured_steps"] + s["warmup_steps"],
    }
    assert set(steps["samples"]) == {8}
    assert [r["measured_steps"] for r in s["ranks"]] == [s["measured_steps"]] * 2


def test_more_gpus_than_present_is_a_usage_error(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UsageError, match="--gpus 4 needs 4 GPUs but this machine has 2"):
        run_training(TrainConfig(workload="tiny_cnn", gpus=4), tmp_path)
    with pytest.raises(UsageError, match="--nccl-transport needs --gpus 2"):
        TrainConfig(workload="tiny_cnn", nccl_transport="socket")
    with pytest.raises(UsageError, match="unknown NCCL transport"):
        TrainConfig(workload="tiny_cnn", gpus=2, nccl_transport="ib")


def test_cli_gpus_without_gpus_names_the_cpu_fallback(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["run", "tiny_cnn", "--gpus", "2", "--steps", "2", "--no-store"])
    err = capsys.readouterr().err
    assert code == 2
    assert "use --device cpu" in err and "Traceback" not in err


def test_multi_gpu_breakdown_adds_the_communication_excess():
    free, cached, cold = Measured(1.0, 0.01), Measured(1.5, 0.0), Measured(2.0, 0.0)
    multi, socket = Measured(1.5, 0.02), Measured(2.5, 0.0)
    shares, cis = breakdown(free, cached, cold, multi, socket)
    # total per GPU: cold 2.0 + interconnect 0.5 + network 1.0 = 3.5
    assert shares["compute"] == pytest.approx(100 / 3.5)
    assert shares["interconnect_stall"] == pytest.approx(50 / 3.5)
    assert shares["network_stall"] == pytest.approx(100 / 3.5)
    assert sum(shares.values()) == pytest.approx(100.0)
    # share = (multi - free) / T with T = cold + socket - free: d/d multi = 1/T,
    # d/d free = -1/T + 0.5/T^2 (the free run is in the total too)
    d_free = -1 / 3.5 + 0.5 / 3.5**2
    want = 100 * ((0.02 / 3.5) ** 2 + (0.01 * d_free) ** 2) ** 0.5
    assert cis["interconnect_stall"] == pytest.approx(want)
    recs = recommend(shares, {}, current=100.0, workers=4)
    by_action = {r["action"].split(":")[0]: r for r in recs}
    network = next(r for r in recs if "NVLink" in r["action"])
    assert network["predicted_gain_pct"] == pytest.approx(100 * (1.0 / 2.5))
    assert len(by_action) == len(recs) >= 3


def test_ring_model_fit_recovers_latency_and_bandwidth():
    truth = RingModel(alpha_s=8e-6, beta_bytes_per_s=150e9)
    sizes = [2**k for k in range(13, 29)]
    times = [truth.allreduce_s(s, 2) for s in sizes]
    fit = fit_ring_model(sizes, times, 2)
    assert fit.alpha_s == pytest.approx(8e-6, rel=1e-6)
    assert fit.beta_bytes_per_s == pytest.approx(150e9, rel=1e-6)
    # 4 GPUs: 6 steps moving S/4 each (1.5 S per link) instead of 2 steps of S/2 (1.0 S)
    s = 100e6
    assert fit.allreduce_s(s, 4) == pytest.approx(6 * 8e-6 + 1.5 * s / 150e9)
    with pytest.raises(ValueError):
        fit_ring_model([1, 2], [1.0, 0.5], 2)


def test_scaling_prediction_calibrates_the_exposed_share():
    model = RingModel(alpha_s=0.0, beta_bytes_per_s=1e9)
    grad = 100 * 1024 * 1024  # 100 MiB of gradients: 4 buckets of 25 MiB
    assert ddp_buckets(grad) == 4
    comm_2 = model.allreduce_s(grad, 2, 4)
    pred = calibrate_scaling(0.100, 0.100 + 0.25 * comm_2, grad, model)
    assert pred.exposed_fraction == pytest.approx(0.25)
    assert pred.step_time_s(1) == pytest.approx(0.100)
    assert pred.step_time_s(8) == pytest.approx(0.100 + 0.25 * model.allreduce_s(grad, 8, 4))


def test_stalls_cli_with_two_processes_on_cpu(tmp_path, capsys):
    from gpulens.data.datagen import make_images

    data = tmp_path / "img"
    make_images(data, 200)
    code = main(
        ["stalls", "tiny_cnn", "--data", str(data), "--gpus", "2", "--device", "cpu",
         "--workers", "1", "--batch-size", "8", "--max-duration", "2", "--time-budget", "30",
         "--until-ci", "50", "--no-store", "--json"]
    )  # fmt: skip
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["runs"]["multi_gpu"] and doc["throughput_samples_per_s"]["multi_gpu"] > 0
    assert doc["breakdown_pct"]["interconnect_stall"] is not None
    assert doc["breakdown_pct"]["network_stall"] is None
    assert any("gloo" in n for n in doc["notes"])
    measured = [v for v in doc["breakdown_pct"].values() if v is not None]
    assert sum(measured) == pytest.approx(100.0)


def test_noise_that_makes_a_slower_run_faster_never_gives_negative_or_excess_shares():
    # the cold run came out faster than the cached one, the ingestion-free run slowest of all
    shares, _ = breakdown(Measured(2.0, 0), Measured(1.8, 0), Measured(1.5, 0))
    assert shares["compute"] == pytest.approx(100.0)
    assert shares["prep_stall"] == 0.0 and shares["fetch_stall"] == 0.0


def test_rendezvous_listens_on_the_loopback_only(tmp_path):
    """PyTorch's TCPStore server listens on every interface by default; a single-node run's
    must listen on 127.0.0.1 only (checked on the real sockets of a gloo process group)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import json, os, psutil
        import torch.distributed as dist
        from gpulens.workloads.distributed import free_port, init_group, loopback_env
        os.environ.update(loopback_env())
        init_group("gloo", 0, 1, free_port())
        conns = psutil.Process().net_connections(kind="inet")
        print(json.dumps([c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]))
        dist.destroy_process_group()
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    listening = json.loads(out.stdout.strip().splitlines()[-1])
    assert listening, "the process group should listen somewhere"
    assert set(listening) <= {"127.0.0.1", "::1"}, listening


def _loader_start_method_in_a_spawned_rank(data: str, queue) -> None:
    import multiprocessing

    import torch

    from gpulens.workloads.config import resolve_config
    from gpulens.workloads.models import get_workload
    from gpulens.workloads.recipe import build_loader

    spec = get_workload("tiny_cnn")
    config = TrainConfig(workload="tiny_cnn", data=data, device="cpu", batch_size=4, workers=1)
    eff = resolve_config(config, spec, torch.device("cpu"))
    loader = build_loader(spec, eff, torch.device("cpu"), None, rank=0, world_size=2)
    used = loader.multiprocessing_context or multiprocessing  # None: the process's default
    queue.put((multiprocessing.get_start_method(), used.get_start_method()))


def test_a_spawned_rank_starts_its_loader_workers_as_a_plain_script_would(tmp_path):
    """Each rank of --gpus N is started by spawn, which becomes the rank's default: its loader
    would spawn its workers (each re-importing torch) where one GPU and a torchrun rank fork
    them. The loader asks for the platform's default instead."""
    import multiprocessing

    from gpulens.data.datagen import make_images

    make_images(tmp_path / "images", 8)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    rank = ctx.Process(
        target=_loader_start_method_in_a_spawned_rank, args=(str(tmp_path / "images"), queue)
    )
    rank.start()
    rank_default, loader_method = queue.get(timeout=120)
    rank.join(timeout=30)
    assert rank_default == "spawn"  # what the loader would have used
    assert loader_method == multiprocessing.get_all_start_methods()[0] == "fork"  # Linux
