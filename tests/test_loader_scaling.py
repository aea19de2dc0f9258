"""The loader probe: real processes preparing a real image folder's samples at once."""

from __future__ import annotations

import json
import time

import pytest

from gpulens.data.loader_scaling import (
    non_increasing,
    pace_at,
    probe_counts,
    probe_loader_scaling,
)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from gpulens.data.datagen import make_images

    out = tmp_path_factory.mktemp("scaling") / "images"
    make_images(out, 24, image_size=(64, 48), num_classes=3)
    return out


def test_the_counts_run_from_one_process_to_every_cpu():
    assert probe_counts(1) == [1]
    assert probe_counts(2) == [1, 2]
    assert probe_counts(16) == [1, 2, 4, 6, 8, 10, 12, 14, 16]
    assert probe_counts(64) == [1, 2, 8, 16, 24, 32, 40, 48, 56, 64]
    assert probe_counts(7)[-1] == 7


def test_pace_is_linear_between_counts_and_time_sliced_past_the_last():
    scaling = {"processes": [1, 2, 8, 16], "samples_per_s_per_process": [100, 100, 100, 60]}
    assert pace_at(scaling, 1) == 100 and pace_at(scaling, 0.5) == 100
    assert pace_at(scaling, 12) == pytest.approx(80)
    # 16 processes share the cores 32 processes want: each gets half of its pace at 16
    assert pace_at(scaling, 32) == pytest.approx(30)


def test_a_probe_point_above_an_earlier_one_is_pooled_with_it():
    # more processes busy cannot make each faster: 120 after 100 is the windows' noise
    assert non_increasing([100, 120, 90]) == [110, 110, 90]
    assert non_increasing([200, 150, 160, 170, 100]) == [200, 160, 160, 160, 100]
    assert non_increasing([3, 2, 1]) == [3, 2, 1]
    scaling = {"processes": [1, 2, 4], "samples_per_s_per_process": [100, 120, 90]}
    assert pace_at(scaling, 2) == pytest.approx(110)
    assert scaling["samples_per_s_per_process"] == [100, 120, 90]  # the record keeps its points


def test_the_probe_times_the_dataset_without_adding_to_the_runs_rows(images, tmp_path):
    from gpulens.data.datasets import image_folder_dataset

    timing = tmp_path / "series"
    skips = tmp_path / "skipped.tsv"
    ds = image_folder_dataset(images, 32, timing_dir=timing, skip_bad_samples=True, skip_log=skips)
    got = probe_loader_scaling(ds, cpus=2, window_s=0.2)
    assert got["processes"] == [1, 2] and got["window_s"] == 0.2
    assert all(p > 10 for p in got["samples_per_s_per_process"])  # 64x48 JPEGs: hundreds/s
    json.dumps(got)  # it goes into run.json as it is
    # the run's own prep rows and skip log stay the run's: the probe's samples are not in them
    assert not timing.exists() and not skips.exists()
    assert ds.timing_dir == timing and ds.skip_log == skips


class _Slow:
    """A dataset whose samples take ``sample_s`` of CPU, or fail."""

    def __init__(self, sample_s: float, fail: bool = False):
        self.sample_s, self.fail = sample_s, fail

    def __len__(self):
        return 8

    def __getitem__(self, index):
        if self.fail:
            raise OSError("disk gone")
        t0 = time.thread_time()
        while time.thread_time() - t0 < self.sample_s:
            pass
        return index


def test_the_pace_is_the_datasets_own():
    got = probe_loader_scaling(_Slow(0.01), cpus=1, window_s=0.3)
    assert got["processes"] == [1]
    assert got["samples_per_s_per_process"][0] == pytest.approx(100, rel=0.3)


def test_a_dataset_that_fails_gives_no_probe():
    assert probe_loader_scaling(_Slow(0.0, fail=True), cpus=2, window_s=0.1) is None


def test_only_a_one_process_run_that_asks_probes_its_loader(images):
    """`gpulens run --prep-timing` asks for the probe; the several runs of `gpulens stalls` time
    their prep without it (a few seconds each); no loader or no workers, nothing to probe."""
    import torch

    from gpulens.workloads.config import TrainConfig, resolve_config
    from gpulens.workloads.models import get_workload

    spec, cpu = get_workload("tiny_cnn"), torch.device("cpu")

    def probes(**kw) -> bool:
        return resolve_config(TrainConfig("tiny_cnn", device="cpu", **kw), spec, cpu).loader_probe

    assert probes(data=str(images), workers=2, prep_timing=True, loader_probe=True)
    assert not probes(data=str(images), workers=2, prep_timing=True)
    assert not probes(data=str(images), workers=0, prep_timing=True, loader_probe=True)
    assert not probes(data="synthetic", loader_probe=True)
