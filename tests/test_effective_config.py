"""The effective config: frozen, typed, and its JSON the run.json ``effective_config`` of the
golden H100 records (so records before and after the type read the same)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gpulens.workloads.config import EffectiveTrainConfig, TrainConfig, resolve_config

FIXTURES = Path(__file__).parent / "fixtures"
RECORDS = [
    "record_h100_resnet50_synthetic",
    "record_h100_resnet50_jpeg",
    "prep_h100_resnet50_paired",
]
# Settings added after the oldest golden record was made.
LATER_SETTINGS = {
    "worker_affinity", "paired_cold_block", "skip_bad_samples", "storage_latency_s",
    "storage_bandwidth_bytes_per_s", "prep_timing", "gpus", "nccl_transport", "ddp_bucket_mb",
    "loader_probe",
}  # fmt: skip


class _Device:
    def __init__(self, kind: str):
        self.type = kind

    def __str__(self) -> str:
        return f"{self.type}:0" if self.type == "cuda" else self.type


def _resolved(**kw) -> EffectiveTrainConfig:
    from gpulens.workloads.models import get_workload

    config = TrainConfig(workload="tiny_cnn", **kw)
    return resolve_config(config, get_workload("tiny_cnn"), _Device(kw.pop("device", "cpu")))


@pytest.mark.parametrize("name", RECORDS)
def test_stored_effective_configs_read_back_to_the_same_json(name):
    doc = json.loads((FIXTURES / name / "run.json").read_text())["effective_config"]
    out = EffectiveTrainConfig.from_dict(doc).as_dict()
    assert {k: out[k] for k in doc} == doc
    # Settings the record predates get what those runs ran with.
    assert set(out) - set(doc) <= LATER_SETTINGS
    assert out.get("skip_bad_samples", False) is False


def test_the_effective_config_is_frozen_and_grows_only_by_copy():
    eff = _resolved(steps=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        eff.optimizer = "SGD"  # type: ignore[misc]
    built = eff.with_built(optimizer="SGD", dataset={"kind": "synthetic_on_device"})
    assert eff.optimizer is None and built.optimizer == "SGD"
    # Built settings appear in the JSON only once known; the requested ones always do.
    assert "dataset" not in eff.as_dict() and eff.as_dict()["optimizer"] is None
    assert built.as_dict()["dataset"] == {"kind": "synthetic_on_device"}
    assert "backend" not in built.as_dict()


def test_choices_left_to_gpulens_are_made():
    eff = _resolved()
    assert (eff.steps, eff.duration_s, eff.warmup_steps) == (100, None, 10)
    assert eff.workers == 0 and eff.channels_last is False
    until_ci = _resolved(until_ci_pct=2.0)
    assert until_ci.steps is None and until_ci.duration_s == 600.0


def test_an_impossible_effective_config_is_refused():
    eff = _resolved(steps=5)
    with pytest.raises(ValueError, match="batch size"):
        dataclasses.replace(eff, batch_size=0)
    with pytest.raises(ValueError, match="step count or a duration"):
        dataclasses.replace(eff, steps=None)


def test_a_cpu_run_records_the_built_settings(tmp_path):
    from gpulens.record.reader import read_record
    from gpulens.workloads.train import run_training

    r = run_training(TrainConfig("tiny_cnn", steps=3, batch_size=4, device="cpu"), tmp_path)
    eff = read_record(r.record_dir).meta["effective_config"]
    assert eff["optimizer"] == "SGD"
    assert eff["dataset"]["kind"] == "synthetic_on_device"
    assert EffectiveTrainConfig.from_dict(eff).as_dict() == eff
    assert r.effective_config["batch_size"] == 4
