"""What the run ran on: host, software and GPUs, captured once per run."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
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


def torch_facts() -> dict[str, Any]:
    """torch's version, its CUDA runtime and cuDNN (None where torch is not installed).

    From the loaded module where the process has imported torch; otherwise from torch's files,
    as a command run's parent never needs torch and importing it costs seconds."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch_facts_from_module(torch)
    return torch_facts_from_files()


def torch_facts_from_module(torch: Any) -> dict[str, Any]:
    """The facts as an imported torch gives them."""
    cudnn = torch.backends.cudnn
    return {
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cudnn": cudnn.version() if cudnn.is_available() else None,
    }


def torch_facts_from_files() -> dict[str, Any]:
    """The same facts without importing torch: ``torch/version.py``'s constants, and cuDNN's
    version from the pip package torch loads it from (None where it came otherwise, e.g. conda)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return {"torch": None}
    constants: dict[str, Any] = {}
    try:
        tree = ast.parse(
            (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
        )
    except (OSError, SyntaxError) as exc:
        log.debug("torch's version.py unreadable (%s)", exc)
        return {"torch": None}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            constants[target.id] = value.value
    cuda = constants.get("cuda")
    return {
        "torch": constants.get("__version__"),
        "cuda_runtime": cuda,
        "cudnn": _pip_cudnn_version(cuda),
    }


def _pip_cudnn_version(cuda: str | None) -> int | None:
    """cuDNN's version as ``torch.backends.cudnn.version()`` gives it (9.1.0 -> 90100, 8.9.2 ->
    8902), from the nvidia-cudnn-cuXX wheel matching torch's CUDA major version."""
    if not cuda:
        return None
    try:
        text = importlib.metadata.version(f"nvidia-cudnn-cu{cuda.split('.')[0]}")
        major, minor, patch = (int(part) for part in text.split(".")[:3])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None
    return major * (10000 if major >= 9 else 1000) + minor * 100 + patch


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, as `taskset` or a container sets it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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
        "cpu_affinity_count": usable_cpus() if hasattr(os, "sched_getaffinity") else None,
        "ram_bytes": psutil.virtual_memory().total,
        "git_commit": git_commit(Path.cwd()),
    }
    env.update(torch_facts())
    gpus = gpus or []
    env["gpu_count"] = len(gpus)
    env["gpu_model"] = gpus[0]["name"] if gpus else None
    env["driver_version"] = gpus[0].get("driver_version") if gpus else None
    env["cuda_driver_version"] = gpus[0].get("cuda_driver_version") if gpus else None
    env["gpus"] = gpus
    return env
