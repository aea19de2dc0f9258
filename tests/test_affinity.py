"""Pinning loader workers to physical cores: topology from sysfs, the plan, the real pin."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from gpulens.data import affinity
from gpulens.data.affinity import PinWorkers, physical_cores, worker_cpus, worker_init
from gpulens.errors import UsageError
from gpulens.workloads.config import TrainConfig


def _fake_sysfs(root: Path, cpu_core: dict[int, tuple[int, int]]) -> Path:
    for cpu, (package, core) in cpu_core.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
    return root


# 8 logical CPUs on 4 cores, Linux-style numbering: CPU i and i+4 are hyper-thread siblings.
HT = {i: (0, i % 4) for i in range(8)}


def test_physical_cores_groups_siblings(tmp_path):
    sysfs = _fake_sysfs(tmp_path, HT)
    assert physical_cores(set(range(8)), sysfs) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # only the CPUs this process may use count
    assert physical_cores({1, 5, 2}, sysfs) == [[1, 5], [2]]


def test_worker_cpus_fill_cores_before_siblings_and_spare_the_first_core(tmp_path):
    sysfs = _fake_sysfs(tmp_path, HT)
    assert worker_cpus(3, set(range(8)), sysfs) == [1, 2, 3]
    assert worker_cpus(4, set(range(8)), sysfs) == [1, 2, 3, 0]
    assert worker_cpus(6, set(range(8)), sysfs) == [1, 2, 3, 0, 5, 6]
    assert worker_cpus(10, set(range(8)), sysfs) == [1, 2, 3, 0, 5, 6, 7, 4, 1, 2]


def test_no_topology_means_one_core_per_cpu(tmp_path):
    assert physical_cores({3, 1}, tmp_path) == [[1], [3]]
    assert worker_cpus(2, {0, 1, 2}, tmp_path) == [1, 2]


def test_two_packages_with_the_same_core_ids_are_different_cores(tmp_path):
    sysfs = _fake_sysfs(tmp_path, {0: (0, 0), 1: (1, 0), 2: (0, 0), 3: (1, 0)})
    assert physical_cores({0, 1, 2, 3}, sysfs) == [[0, 2], [1, 3]]


def test_os_affinity_installs_nothing():
    assert worker_init("os", 4) is None
    assert worker_init("cores", 0) is None


def test_ranks_take_successive_slots(monkeypatch, tmp_path):
    sysfs = _fake_sysfs(tmp_path, HT)
    monkeypatch.setattr(affinity, "_SYSFS_CPU", sysfs)
    monkeypatch.setattr(affinity.os, "sched_getaffinity", lambda _pid: set(range(8)))
    monkeypatch.setattr(
        affinity, "worker_cpus",
        lambda n, allowed, sysfs=sysfs: worker_cpus(n, allowed, sysfs),
    )  # fmt: skip
    assert worker_init("cores", 2, rank=0).cpus == [1, 2]
    assert worker_init("cores", 2, rank=1).cpus == [3, 0]


def test_pin_failure_is_a_warning_not_a_crash(monkeypatch, caplog):
    def refuse(_pid, _cpus):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(affinity.os, "sched_setaffinity", refuse)
    PinWorkers([5])(0)
    assert "could not pin loader worker 0 to CPU 5" in caplog.text


class _WhereAmI(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return torch.tensor(sorted(os.sched_getaffinity(0)))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_a_real_worker_runs_on_its_cpu():
    parent_before = os.sched_getaffinity(0)
    cpus = worker_init("cores", 1).cpus
    loader = torch.utils.data.DataLoader(
        _WhereAmI(), batch_size=1, num_workers=1, worker_init_fn=worker_init("cores", 1)
    )
    seen = {tuple(b[0].tolist()) for b in loader}
    assert seen == {(cpus[0],)}
    assert os.sched_getaffinity(0) == parent_before  # the training process is not pinned


def test_unknown_affinity_is_a_usage_error():
    with pytest.raises(UsageError, match="use one of os, cores"):
        TrainConfig(workload="resnet18", worker_affinity="numa")


def test_cli_rejects_an_unknown_affinity_in_one_line(capsys):
    from gpulens.cli import main

    assert main(["run", "tiny_cnn", "--worker-affinity", "numa"]) == 2
    err = capsys.readouterr().err
    assert "use one of os, cores" in err and "Traceback" not in err
