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
from gpulens.workloads.jobspec import JobSpec


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


def unavailable_reason(
    mechanism: str, info: DeviceInfo, jobs: list[JobSpec], *, check_mps: bool = True
) -> str | None:
    """Why ``mechanism`` cannot run ``jobs`` on ``info`` (``"unavailable: ..."``), found before
    anything runs; None when it can. ``check_mps=False`` skips the look for an MPS control
    binary and for foreign daemons (a test's fake MPS)."""
    if mechanism == "streams":
        if not info.cuda:
            return "unavailable: CUDA streams need a GPU (this run uses the CPU)"
        if any(not j.builtin for j in jobs):
            return ("unavailable: streams run built-in jobs in one process; cmd: and serve: jobs "
                    "run in their own")  # fmt: skip
    elif mechanism == "mps":
        if not info.cuda:
            return "unavailable: MPS needs a GPU (this run uses the CPU)"
        if check_mps:
            from gpulens.launch.mps import (
                find_foreign_daemons,
                foreign_daemon_message,
                mps_available,
            )

            why = mps_available()
            if why:
                return why
            foreign = find_foreign_daemons()
            if foreign:
                return "unavailable: " + foreign_daemon_message(foreign)
    elif mechanism == "mig":
        if not info.cuda or info.nvml_index is None:
            return "unavailable: MIG needs an NVIDIA GPU that NVML can see"
        from gpulens.probes.nvml.mig import mig_layout

        layout = mig_layout(info.nvml_index)
        if layout.reason:
            return layout.reason
        if len(layout.instances) < len(jobs):
            return (f"unavailable: {len(layout.instances)} MIG instance(s) exist and {len(jobs)} "
                    "jobs need one each; gpulens does not change the MIG layout")  # fmt: skip
    return None


def check_measurable(reasons: dict[str, str | None], info: DeviceInfo) -> None:
    """A usage error, before any job runs alone, when none of the mechanisms asked for can run
    (``reasons``: mechanism -> :func:`unavailable_reason`)."""
    if not reasons or not all(reasons.values()):
        return
    why = "; ".join(f"{m}: {r.removeprefix('unavailable: ')}" for m, r in reasons.items() if r)
    fix = "--mechanisms time-slice" + ("" if info.cuda else ", or a GPU (--device cuda:N)")
    raise UsageError(f"none of the mechanisms asked for can run here ({why}): use {fix}")
