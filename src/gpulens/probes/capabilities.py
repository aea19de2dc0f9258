"""What gpulens can measure on this machine (``gpulens doctor``)."""

from __future__ import annotations

import importlib
import importlib.util
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from gpulens.paths import default_tracking_uri, gpulens_home


@dataclass
class Check:
    name: str
    ok: bool
    value: Any
    how_to_enable: str | None = None


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def run_checks() -> list[Check]:
    """One check per capability; a missing one says how to enable it."""
    from gpulens.probes.nvml.inventory import describe_gpus
    from gpulens.probes.nvml.session import nvml_status

    checks: list[Check] = []
    nvml_ok, nvml_message = nvml_status()
    checks.append(
        Check("nvml", nvml_ok, nvml_message if nvml_ok else "not available",
              None if nvml_ok else nvml_message)
    )  # fmt: skip
    gpus = describe_gpus() if nvml_ok else []
    for g in gpus:
        summary = (
            f"{g.get('name')} ({(g.get('memory_total_bytes') or 0) / 2**30:.0f} GiB), driver "
            f"{g.get('driver_version')}, CUDA {g.get('cuda_driver_version')}"
        )
        checks.append(Check(f"gpu{g['index']}", True, summary))
        gpm = bool(g.get("gpm_supported"))
        checks.append(
            Check(f"gpu{g['index']}.gpm", gpm, "supported" if gpm else "not supported",
                  None if gpm else "GPM metrics (SM activity, occupancy, tensor activity, DRAM "
                  "bandwidth) need a Hopper or newer GPU and driver 520+")
        )  # fmt: skip
        mig = g.get("mig_mode")
        checks.append(
            Check(f"gpu{g['index']}.mig", True,
                  {True: "enabled", False: "disabled", None: "not supported"}[mig])
        )  # fmt: skip
    try:
        import torch

        cuda = torch.cuda.is_available()
        checks.append(
            Check("torch", True, f"{torch.__version__} (CUDA {torch.version.cuda}, "
                  f"{torch.cuda.device_count() if cuda else 0} visible GPU(s))")
        )  # fmt: skip
        if not cuda:
            checks.append(
                Check("cuda", False, "no CUDA device visible to torch",
                      "install a CUDA build of torch and an NVIDIA driver; gpulens runs on the "
                      "CPU meanwhile")
            )  # fmt: skip
    except ImportError:
        checks.append(Check("torch", False, "not installed", "pip install torch torchvision"))
    mps = shutil.which("nvidia-cuda-mps-control")
    checks.append(
        Check("mps", bool(mps), mps or "not found",
              None if mps else "MPS collocation needs nvidia-cuda-mps-control on PATH "
              "(part of the NVIDIA driver utilities)")
    )  # fmt: skip
    cpus = psutil.cpu_count(logical=True)
    checks.append(Check("cpu", True, f"{cpus} logical cores"))
    checks.append(Check("ram", True, f"{psutil.virtual_memory().total / 2**30:.1f} GiB"))
    home = gpulens_home()
    probe_dir = home if home.exists() else Path(home).parent
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    free = shutil.disk_usage(probe_dir).free
    checks.append(Check("home", True, f"{home} ({free / 2**30:.1f} GiB free)"))
    checks.append(Check("store", _has("mlflow"), default_tracking_uri(),
                        None if _has("mlflow") else
                        "records stay local until `pip install 'gpulens[store]'`, then "
                        "`gpulens runs sync`"))  # fmt: skip
    return checks


def checks_as_dict(checks: list[Check]) -> dict[str, Any]:
    return {"checks": [asdict(c) for c in checks]}


# pyproject.toml's optional extras ([dev] aside): what each enables and the modules gpulens
# imports from it (serve's speed-ups, uvloop and httptools, are not required)
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "store": ("the MLflow store: runs sync, runs list --store", ("mlflow",)),
    "team": ("a team store on PostgreSQL", ("mlflow", "psycopg2")),
    "ui": ("report and ui (plotly)", ("plotly",)),
    "serve": ("serve and load", ("starlette", "uvicorn", "aiohttp")),
    "sweep": ("sweep --executor ray", ("ray",)),
}


@dataclass
class Extra:
    name: str
    installed: bool
    used_for: str
    missing_modules: list[str]
    install_command: str | None


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # not installed, or installed but broken: either way not usable
        return False
    return True


def extras_status() -> list[Extra]:
    """Whether each optional extra's modules import, and the pip command where not."""
    extras = []
    for name, (used_for, modules) in EXTRAS.items():
        missing = [m for m in modules if not _imports(m)]
        install = f"pip install 'gpulens[{name}]'" if missing else None
        extras.append(Extra(name, not missing, used_for, missing, install))
    return extras
