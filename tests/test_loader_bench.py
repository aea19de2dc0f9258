"""The loader alone: its pace over a real JPEG folder, and the errors a user can make."""

from __future__ import annotations

import pytest

from gpulens.errors import UsageError
from gpulens.stalls.loader_bench import measure_loader
from gpulens.workloads.config import TrainConfig


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    from gpulens.data.datagen import make_images

    out = tmp_path_factory.mktemp("data") / "images"
    make_images(out, 48)
    return out


def test_loader_pace_is_set_by_the_storage_delay(jpegs):
    """One worker behind 30 ms of emulated latency per file cannot beat 33 samples/s, and the
    pace it shows is close to that bound (decoding a small JPEG takes a few ms)."""
    config = TrainConfig(
        workload="tiny_cnn", data=str(jpegs), workers=1, batch_size=4, device="cpu",
        storage_latency_s=0.030,
    )  # fmt: skip
    pace = measure_loader(config, duration_s=1.5)
    assert pace.workers == 1 and pace.batch_size == 4
    assert pace.batches >= 5
    assert 20.0 < pace.samples_per_s < 1 / 0.030
    assert pace.per_sample_s == pytest.approx(1 / pace.samples_per_s)


def test_loader_pace_needs_on_disk_data():
    with pytest.raises(UsageError, match="--data"):
        measure_loader(TrainConfig(workload="tiny_cnn", device="cpu"))
    with pytest.raises(UsageError, match="positive duration"):
        measure_loader(TrainConfig(workload="tiny_cnn", device="cpu", data="."), duration_s=0)
