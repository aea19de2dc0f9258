"""The GPU a collocation experiment runs on: name, NVML index, memory, MIG mode."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from gpulens.errors import RuntimeFailure, UsageError
from gpulens.launch.processes import (
    reap,
    spawn,
)


@dataclass
class DeviceInfo:
    device: str  # "cpu" or "cuda:0" as the children see it
    name: str | None = None
    uuid: str | None = None
    memory_total_bytes: int | None = None
    nvml_index: int | None = None

    @property
    def cuda(self) -> bool:
        return self.device != "cpu"

    def as_dict(self) -> dict[str, Any] | None:
        if not self.cuda:
            return None
        return {"name": self.name, "uuid": self.uuid, "memory_total_bytes":
                self.memory_total_bytes, "nvml_index": self.nvml_index}  # fmt: skip


def probe_device(device: str | None) -> DeviceInfo:
    """Ask a child process what ``device`` is (the parent never creates a CUDA context)."""
    if device and device.strip().lower() == "cpu":
        return DeviceInfo("cpu")
    proc = spawn(
        [sys.executable, "-m", "gpulens.workloads.colocate_job", "--probe", device or "auto"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        death_signal=signal.SIGKILL, own_group=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        stdout, stderr = "", "no answer within 300 s"
    finally:
        reap(proc, grace_s=1.0)
    try:
        info = json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise RuntimeFailure(
            f"could not start a job process ({(stderr or '').strip()[-300:]}); "
            "check that torch imports: python -c 'import torch'"
        ) from None
    if info.get("error"):
        raise UsageError(info["error"])
    if info["device"] == "cpu":
        return DeviceInfo("cpu")
    from gpulens.probes.nvml.inventory import nvml_index_for_uuid

    nvml_index = nvml_index_for_uuid(info.get("uuid")).index
    return DeviceInfo("cuda:0", info.get("name"), info.get("uuid"),
                      info.get("memory_total_bytes"), nvml_index)  # fmt: skip
