"""Record an NVML replay fixture on a real GPU.

Runs the GPU probe for about 30 samples at 10 Hz while a small matrix-multiply loop (and
host-to-device copies, for PCIe traffic) keeps the GPU busy, and writes to OUT_DIR:

- ``raw_calls.json``: every pynvml call the probe made, with its raw return value or error
  code, per phase (``describe``, ``open``, ``sample_0``..., ``close``); the format is described
  in ``tests/nvml_replay.py``, which replays it;
- ``gpu_samples.parquet``: the probe's rows;
- ``describe.json``: ``describe_gpus()``, the probe's ``unsupported`` and ``sources``, and the
  cost of each sample.

Usage: ``python benchmarks/record_nvml_fixture.py [OUT_DIR] [--samples 30] [--interval-s 0.1]
[--gpu N ...] [--idle]``
OUT_DIR defaults to ``$OUT/nvml_h100`` where ``$OUT`` is set, else ``tests/fixtures/nvml_h100``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from gpulens.probes.nvml import probe as gpu_probe  # noqa: E402
from gpulens.probes.nvml.inventory import describe_gpus  # noqa: E402

FORMAT = "gpulens-nvml-raw-calls/1"
log = logging.getLogger("record_nvml_fixture")


class RecordingNvml(types.ModuleType):
    """Wraps the real pynvml: every ``nvml*`` call is passed through and recorded."""

    def __init__(self, real: types.ModuleType):
        super().__init__("pynvml")
        self._real = real
        self._handles: dict[int, int] = {}  # address -> NVML index
        self._samples: dict[int, int] = {}  # address -> allocation number
        self.constants: dict[str, Any] = {}
        self.missing: set[str] = set()
        self.error_texts: dict[int, str] = {}
        self.phases: dict[str, list[dict[str, Any]]] = {}
        self.calls: list[dict[str, Any]] = []

    def start_phase(self, name: str) -> None:
        self.calls = self.phases.setdefault(name, [])

    def __dir__(self) -> list[str]:
        return dir(self._real)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            attr = getattr(self._real, name)
        except AttributeError:
            self.missing.add(name)
            raise
        if name.startswith("nvml") and callable(attr):
            return lambda *args: self._record(name, attr, args)
        if isinstance(attr, (int, float, str)) and not isinstance(attr, bool):
            self.constants[name] = attr
        return attr

    # The probe's clocks, recorded like calls.
    def monotonic(self) -> float:
        return self._clock("__monotonic__", time.monotonic)

    def wall_time(self) -> float:
        return self._clock("__wall_time__", time.time)

    def _clock(self, name: str, fn: Any) -> float:
        value = fn()
        self.calls.append({"fn": name, "args": [], "ret": value})
        return value

    def _record(self, name: str, fn: Any, args: tuple[Any, ...]) -> Any:
        call: dict[str, Any] = {"fn": name, "args": [self._encode(a) for a in args]}
        self.calls.append(call)
        try:
            result = fn(*args)
        except self._real.NVMLError as exc:
            call["error"] = exc.value
            self.error_texts[exc.value] = str(exc)
            raise
        if name == "nvmlDeviceGetHandleByIndex":
            self._handles[_address(result)] = int(args[0])
        elif name == "nvmlGpmSampleAlloc":
            self._samples[_address(result)] = len(self._samples)
        call["ret"] = self._encode(result, with_result=True)
        return result

    def _encode(self, obj: Any, with_result: bool = False) -> Any:
        real = self._real
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, bytes):
            return obj.decode(errors="replace")
        if isinstance(obj, (list, tuple)):
            return [self._encode(x) for x in obj]
        if isinstance(obj, ctypes._Pointer):
            address = _address(obj)
            if address in self._handles:
                return {"__handle__": self._handles[address]}
            if address in self._samples:
                return {"__gpm_sample__": self._samples[address]}
            return {"__pointer__": None}
        if isinstance(obj, real.c_nvmlGpmMetricsGet_t):
            count = int(obj.numMetrics)
            body: dict[str, Any] = {
                "sample1": self._samples.get(_address(obj.sample1)),
                "sample2": self._samples.get(_address(obj.sample2)),
                "metric_ids": [int(obj.metrics[i].metricId) for i in range(count)],
            }
            if with_result:
                body["metrics"] = [
                    {
                        "metricId": int(obj.metrics[i].metricId),
                        "nvmlReturn": int(obj.metrics[i].nvmlReturn),
                        "value": float(obj.metrics[i].value),
                    }
                    for i in range(count)
                ]
            return {"__gpm_metrics_get__": body}
        if isinstance(obj, ctypes.Array) and obj._type_ is real.c_nvmlFieldValue_t:
            return {"__field_values__": [_field_value(real, v) for v in obj]}
        if isinstance(obj, ctypes.Array):
            return [self._encode(x) for x in obj]
        if isinstance(obj, ctypes.Structure):
            return {"__struct__": {f[0]: self._encode(getattr(obj, f[0])) for f in obj._fields_}}
        if isinstance(obj, ctypes._SimpleCData):
            return obj.value
        return repr(obj)

    def recording(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "pynvml_version": _pynvml_version(),
            "recorded_at_unix_s": time.time(),
            "constants": dict(sorted(self.constants.items())),
            "missing": sorted(self.missing),
            "error_texts": {str(k): v for k, v in sorted(self.error_texts.items())},
            "phases": self.phases,
        }


def _address(pointer: Any) -> int:
    return ctypes.cast(pointer, ctypes.c_void_p).value or 0


def _field_value(real: Any, value: Any) -> dict[str, Any]:
    member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
    raw = getattr(value.value, member.get(int(value.valueType), "ullVal"))
    return {
        "fieldId": int(value.fieldId),
        "scopeId": int(value.scopeId),
        "timestamp": int(value.timestamp),
        "latencyUsec": int(value.latencyUsec),
        "valueType": int(value.valueType),
        "nvmlReturn": int(value.nvmlReturn),
        "value": raw,
    }


def _pynvml_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("nvidia-ml-py")
    except Exception:  # the version is only informative
        return None


class GpuLoad:
    """Matrix multiplies and host-to-device copies on every visible CUDA device, in threads."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.error: str | None = None

    def __enter__(self) -> GpuLoad:
        try:
            import torch
        except ImportError:
            self.error = "torch is not installed; recording an idle GPU"
            return self
        if not torch.cuda.is_available():
            self.error = "CUDA is not available to torch; recording an idle GPU"
            return self
        for device in range(torch.cuda.device_count()):
            thread = threading.Thread(target=self._run, args=(torch, device), daemon=True)
            thread.start()
            self._threads.append(thread)
        time.sleep(1.0)  # let clocks and counters rise
        return self

    def _run(self, torch: Any, device: int) -> None:
        try:
            with torch.cuda.device(device):
                a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
                host = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
                while not self._stop.is_set():
                    for _ in range(20):
                        a = torch.tanh(a @ a)
                    host.to("cuda", non_blocking=True)
                    torch.cuda.synchronize()
        except Exception as exc:  # the recording goes on without load
            self.error = f"GPU load on device {device} failed: {exc}"

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)


def record(
    out_dir: Path, samples: int, interval_s: float, indices: list[int] | None, idle: bool = False
) -> int:
    """Record a fixture into ``out_dir``; returns a process exit code."""
    try:
        import pynvml
    except ImportError:
        log.error("pynvml is not installed: pip install nvidia-ml-py")
        return 1
    recorder = RecordingNvml(pynvml)
    sys.modules["pynvml"] = recorder
    out_dir.mkdir(parents=True, exist_ok=True)

    recorder.start_phase("describe")
    described = describe_gpus()
    rows: list[dict[str, Any]] = []
    costs_s: list[float] = []
    with contextlib.nullcontext(None) if idle else GpuLoad() as load:
        recorder.start_phase("open")
        probe = gpu_probe.open_gpu_probe(
            indices,
            monotonic=recorder.monotonic,
            wall_time=recorder.wall_time,
        )
        if isinstance(probe, gpu_probe.NullGpuProbe):
            log.error("no GPU probe: %s", probe.reason)
            return 1
        next_s = time.monotonic()
        for i in range(samples):
            recorder.start_phase(f"sample_{i}")
            rows.extend(probe.sample())
            costs_s.append(probe.last_sample_cost_s)
            next_s += interval_s
            time.sleep(max(0.0, next_s - time.monotonic()))
        recorder.start_phase("close")
        probe.close()
    if load is not None and load.error:
        log.warning("%s", load.error)

    (out_dir / "raw_calls.json").write_text(json.dumps(recorder.recording(), indent=1) + "\n")
    table = pa.Table.from_pylist(rows, schema=gpu_probe.GPU_SAMPLE_SCHEMA)
    pq.write_table(table, out_dir / "gpu_samples.parquet")
    meta = {
        "gpus": described,
        "unsupported": probe.unsupported,
        "sources": {str(k): v for k, v in probe.sources.items()},
        "gpu_indices": probe.gpu_indices,
        "sample_interval_s": interval_s,
        "sample_cost_s": costs_s,
        "load": "none (idle)"
        if load is None
        else load.error or "bf16 matmul loop and 64 MiB host-to-device copies",
    }
    (out_dir / "describe.json").write_text(json.dumps(meta, indent=1) + "\n")
    log.info(
        "wrote %s: %d rows; unsupported: %s; median sample cost %.2f ms",
        out_dir,
        len(rows),
        sorted(probe.unsupported) or "none",
        sorted(costs_s)[len(costs_s) // 2] * 1000 if costs_s else float("nan"),
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_root = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "tests/fixtures"
    parser.add_argument("out_dir", nargs="?", type=Path, default=default_root / "nvml_h100")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--interval-s", type=float, default=0.1)
    parser.add_argument("--gpu", type=int, action="append", help="NVML index (repeatable)")
    parser.add_argument("--idle", action="store_true", help="record without the GPU load")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return record(args.out_dir, args.samples, args.interval_s, args.gpu, args.idle)


if __name__ == "__main__":
    sys.exit(main())
