"""The store's one sink interface: the background logger talks only to sinks, a fan-out tries
every sink and reports the first failure, and the null sink is what ``GPULENS_STORE=0`` gives."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpulens.record.writer import RunWriter
from gpulens.store import background
from gpulens.store.availability import StoreUnavailableError
from gpulens.store.sink import FanOutSink, MlflowSink, NullSink, RecordSink, default_sink


@dataclass
class _MemorySink:
    """A store in memory: records the directories it was given."""

    name: str = "memory"
    fail_with: BaseException | None = None
    missing: str | None = None
    logged: list[Path] = field(default_factory=list)

    def unavailable_reason(self) -> str | None:
        return self.missing

    def log_record(self, record_dir: Path) -> str:
        if self.fail_with is not None:
            raise self.fail_with
        self.logged.append(Path(record_dir))
        return f"{self.name}-{len(self.logged)}"


def _record(tmp_path: Path) -> Path:
    w = RunWriter(tmp_path / "runs", kind="script", name="r", requested_config={"argv": ["x"]})
    w.update(summary={"throughput_samples_per_s": 10.0})
    w.finish("finished")
    return w.dir


def test_every_sink_satisfies_the_interface():
    for sink in (NullSink(), MlflowSink(), FanOutSink([NullSink()]), _MemorySink()):
        assert isinstance(sink, RecordSink), sink


def test_store_off_gives_the_null_sink_and_nothing_is_logged(tmp_path, monkeypatch):
    monkeypatch.setenv("GPULENS_STORE", "0")
    sink = default_sink()
    assert isinstance(sink, NullSink)
    outcome = background.log_finished(_record(tmp_path))
    assert outcome.status == background.SKIPPED
    assert "GPULENS_STORE" in outcome.message


def test_default_sink_is_mlflow_at_the_given_uri(monkeypatch):
    monkeypatch.delenv("GPULENS_STORE", raising=False)
    sink = default_sink("sqlite:///x.db", "exp")
    assert sink == MlflowSink("sqlite:///x.db", "exp")


def test_background_logger_uses_the_sink_it_is_given(tmp_path):
    record = _record(tmp_path)
    sink = _MemorySink()
    outcome = background.log_finished(record, sink=sink, budget_s=10)
    assert outcome.status == background.LOGGED
    assert outcome.mlflow_run_id == "memory-1"
    assert sink.logged == [record]


def test_an_unavailable_sink_is_skipped_with_its_reason(tmp_path):
    sink = _MemorySink(missing="pip install 'gpulens[other]'")
    outcome = background.log_finished(_record(tmp_path), sink=sink)
    assert outcome.status == background.SKIPPED
    assert outcome.message == "pip install 'gpulens[other]'"
    assert sink.logged == []


def test_fan_out_tries_every_sink_then_raises_the_first_failure(tmp_path):
    record = _record(tmp_path)
    down = _MemorySink("down", fail_with=StoreUnavailableError("server down"))
    up = _MemorySink("up")
    absent = _MemorySink("absent", missing="not installed")
    fan = FanOutSink([down, absent, up])
    assert fan.unavailable_reason() is None
    with pytest.raises(StoreUnavailableError, match="server down"):
        fan.log_record(record)
    assert up.logged == [record] and absent.logged == []
    outcome = background.log_finished(record, sink=fan, budget_s=10)
    assert outcome.status == background.UNAVAILABLE


def test_fan_out_joins_ids_and_is_unavailable_only_when_all_are(tmp_path):
    record = _record(tmp_path)
    fan = FanOutSink([_MemorySink("a"), _MemorySink("b")])
    assert fan.log_record(record) == "a-1,b-1"
    none = FanOutSink([NullSink("off"), _MemorySink(missing="absent")])
    assert none.unavailable_reason() == "off; absent"
