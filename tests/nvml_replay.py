"""A fake ``pynvml`` that replays what ``benchmarks/record_nvml_fixture.py`` recorded on a real GPU.

The recording (``raw_calls.json``) holds, in call order, every pynvml call the probe made with its
encoded arguments and its raw return value or NVML error code, grouped by phase (``describe``,
``open``, ``sample_0``..., ``close``). It also holds the pynvml constants the code read, the ones
it looked for and did not find, and the text of each NVML error code.

Encoding of values: plain JSON for numbers and strings (NaN as JSON ``NaN``);
``{"__handle__": i}`` a device handle (i = NVML index); ``{"__gpm_sample__": k}`` the k-th GPM
sample buffer allocated; ``{"__struct__": {field: value}}`` a ctypes structure;
``{"__field_values__": [...]}`` the result of nvmlDeviceGetFieldValues (each item: fieldId,
scopeId, timestamp, latencyUsec, valueType, nvmlReturn and ``value`` read by valueType);
``{"__gpm_metrics_get__": {"sample1", "sample2", "metric_ids"[, "metrics"]}}`` the request and
result of nvmlGpmMetricsGet. The probe's clocks are recorded as the calls ``__monotonic__`` and
``__wall_time__``.

Replay serves, for each (function, arguments) pair, the recorded results in order; past the
last one it repeats the last. A function or argument never recorded raises ``ReplayMismatch``.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

FORMAT = "gpulens-nvml-raw-calls/1"
_UNION_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


class ReplayMismatch(AssertionError):
    """The code under test made a call that the recording does not hold."""


class _Handle:
    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<replayed handle {self.index}>"


class _GpmSample:
    def __init__(self, number: int):
        self.number = number

    def __repr__(self) -> str:
        return f"<replayed GPM sample {self.number}>"


class _GpmMetricsGet:
    """Stands in for pynvml.c_nvmlGpmMetricsGet_t."""

    def __init__(self, size: int = 64):
        self.version = 0
        self.numMetrics = 0
        self.sample1: Any = None
        self.sample2: Any = None
        self.metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(size)]


def make_error_class(texts: dict[int, str]) -> type[Exception]:
    """An NVMLError like pynvml's: ``NVMLError(code)``, ``.value`` and a readable str()."""

    class NVMLError(Exception):
        def __init__(self, value: int):
            super().__init__(value)
            self.value = value

        def __str__(self) -> str:
            return texts.get(self.value, f"NVML Error with code {self.value}")

        def __eq__(self, other: object) -> bool:
            return isinstance(other, NVMLError) and self.value == other.value

        __hash__ = Exception.__hash__

    return NVMLError


def _key(fn: str, args: list[Any]) -> tuple[str, str]:
    return fn, json.dumps(args, sort_keys=True)


class NvmlReplay(types.ModuleType):
    """A module object to put in ``sys.modules['pynvml']``."""

    def __init__(self, recording: dict[str, Any]):
        super().__init__("pynvml")
        if recording.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} recording: {recording.get('format')!r}")
        self._recording = recording
        self._handles: dict[int, _Handle] = {}
        self._samples: dict[int, _GpmSample] = {}
        self._queues: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self._served: dict[tuple[str, str], int] = {}
        self._functions: set[str] = set()
        self._missing = set(recording.get("missing", []))
        for name, value in recording.get("constants", {}).items():
            setattr(self, name, value)
        texts = {int(code): text for code, text in recording.get("error_texts", {}).items()}
        self.NVMLError = make_error_class(texts)
        self.c_nvmlGpmMetricsGet_t = _GpmMetricsGet
        for calls in recording["phases"].values():
            for call in calls:
                self._functions.add(call["fn"])
                self._queues.setdefault(_key(call["fn"], call["args"]), []).append(call)

    @classmethod
    def load(cls, fixture_dir: Path | str) -> NvmlReplay:
        """Read ``raw_calls.json`` from a fixture directory."""
        path = Path(fixture_dir) / "raw_calls.json"
        return cls(json.loads(path.read_text()))

    @property
    def phases(self) -> dict[str, list[dict[str, Any]]]:
        return self._recording["phases"]

    def sample_count(self) -> int:
        """How many ``sample()`` calls the recording holds."""
        return sum(1 for name in self.phases if name.startswith("sample_"))

    def unserved(self) -> list[str]:
        """Recorded calls that the replay has not served (function names, one per call)."""
        left = []
        for key, calls in self._queues.items():
            left += [key[0]] * max(0, len(calls) - self._served.get(key, 0))
        return left

    # --------------------------------------------------------------------------- serving
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in self._missing:
            raise AttributeError(name)
        if name in self._functions:
            return lambda *args: self._serve(name, list(args))
        raise ReplayMismatch(f"pynvml.{name} was not used in the recording")

    def monotonic(self) -> float:
        """The probe's recorded monotonic clock."""
        return self._serve("__monotonic__", [])

    def wall_time(self) -> float:
        """The probe's recorded wall clock."""
        return self._serve("__wall_time__", [])

    def sleep(self, _seconds: float) -> None:
        """Replays do not wait."""

    def _serve(self, fn: str, args: list[Any]) -> Any:
        encoded = [self._encode_arg(a) for a in args]
        key = _key(fn, encoded)
        calls = self._queues.get(key)
        if not calls:
            raise ReplayMismatch(f"{fn}({key[1]}) was not recorded")
        served = self._served.get(key, 0)
        call = calls[min(served, len(calls) - 1)]
        self._served[key] = served + 1
        if "error" in call:
            raise self.NVMLError(call["error"])
        result = self._decode(call.get("ret"))
        if fn == "nvmlGpmMetricsGet":
            request = args[0]
            for slot, metric in enumerate(result["metrics"]):
                request.metrics[slot].metricId = metric["metricId"]
                request.metrics[slot].nvmlReturn = metric["nvmlReturn"]
                request.metrics[slot].value = metric["value"]
            return request
        if fn == "nvmlGpmSampleGet":
            return args[1]
        return result

    def _encode_arg(self, arg: Any) -> Any:
        if isinstance(arg, _Handle):
            return {"__handle__": arg.index}
        if isinstance(arg, _GpmSample):
            return {"__gpm_sample__": arg.number}
        if isinstance(arg, _GpmMetricsGet):
            return {
                "__gpm_metrics_get__": {
                    "sample1": self._encode_arg(arg.sample1)["__gpm_sample__"],
                    "sample2": self._encode_arg(arg.sample2)["__gpm_sample__"],
                    "metric_ids": [arg.metrics[i].metricId for i in range(arg.numMetrics)],
                }
            }
        if isinstance(arg, (list, tuple)):
            return [self._encode_arg(a) for a in arg]
        return arg

    def _decode(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self._decode(v) for v in value]
        if not isinstance(value, dict):
            return value
        if "__handle__" in value:
            index = value["__handle__"]
            return self._handles.setdefault(index, _Handle(index))
        if "__gpm_sample__" in value:
            number = value["__gpm_sample__"]
            return self._samples.setdefault(number, _GpmSample(number))
        if "__struct__" in value:
            return SimpleNamespace(**{k: self._decode(v) for k, v in value["__struct__"].items()})
        if "__field_values__" in value:
            return [_field_value(item) for item in value["__field_values__"]]
        if "__gpm_metrics_get__" in value:
            return value["__gpm_metrics_get__"]
        return {k: self._decode(v) for k, v in value.items()}


def _field_value(item: dict[str, Any]) -> SimpleNamespace:
    union = SimpleNamespace(**dict.fromkeys(_UNION_MEMBERS, item["value"]))
    return SimpleNamespace(**{**item, "value": union})
