"""What the run ran on: host, software and GPUs, captured once per run."""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)


def git_commit(cwd: Path | None = None) -> str | None:
    """The commit of the code at ``cwd`` (``-dirty`` if changed); None outside git."""
    if not shutil.which("git"):
        return None
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5
        )
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def capture_environment(gpus: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Host, Python, torch, CUDA and GPU facts. ``gpus`` is ``describe_gpus()``'s output."""
    from gpulens import __version__

    env: dict[str, Any] = {
        "gpulens_version": __version__,
        "hostname": platform.node(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_model": cpu_model(),
        "cpu_count_logical": psutil.cpu_count(logical=True),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "cpu_affinity_count": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        "ram_bytes": psutil.virtual_memory().total,
        "git_commit": git_commit(Path.cwd()),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda_runtime"] = torch.version.cuda
        env["cudnn"] = (
            torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        )
    except ImportError:
        env["torch"] = None
    gpus = gpus or []
    env["gpu_count"] = len(gpus)
    env["gpu_model"] = gpus[0]["name"] if gpus else None
    env["driver_version"] = gpus[0].get("driver_version") if gpus else None
    env["cuda_driver_version"] = gpus[0].get("cuda_driver_version") if gpus else None
    env["gpus"] = gpus
    return env
