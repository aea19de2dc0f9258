"""The bundled, dated GPU catalog (peaks, memory, links), extendable with a user CSV.

Units as the vendors' data sheets give them: peaks in dense TFLOP/s (no sparsity), memory in
GB and GB/s; ``nvlink_gb_s`` is NVIDIA's total over both directions (H100 SXM: 900), while
``pcie_gb_s`` is one direction (PCIe 5.0 x16: 64); ``l2_mb`` is the L2 cache in MB (optional,
with ``l2_source``). A user catalog must use the same units.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, fields
from datetime import date
from pathlib import Path

import pandas as pd

from gpulens.errors import UsageError

CATALOG_PATH = Path(__file__).with_name("gpus.csv")
COLUMNS = (
    "gpu",
    "aliases",
    "fp32_tflops",
    "tf32_tflops",
    "bf16_tflops",
    "fp16_tflops",
    "fp8_tflops",
    "mem_gb",
    "mem_bw_gb_s",
    "nvlink_gb_s",
    "pcie_gb_s",
    "source",
    "date",
)
# Columns a user catalog may leave out (rows then lack the rule they feed).
OPTIONAL_COLUMNS = ("l2_mb", "l2_source")
_TEXT = ("gpu", "aliases", "source", "date", "l2_source")


@dataclass(frozen=True)
class GpuSpec:
    """One catalog row; a missing peak (e.g. no BF16 on a T4) is None."""

    gpu: str
    aliases: str
    fp32_tflops: float | None
    tf32_tflops: float | None
    bf16_tflops: float | None
    fp16_tflops: float | None
    fp8_tflops: float | None
    mem_gb: float | None
    mem_bw_gb_s: float | None
    nvlink_gb_s: float | None
    pcie_gb_s: float | None
    source: str
    date: str
    l2_mb: float | None = None  # L2 cache; memory-bound kernels whose bytes fit it are kept
    l2_source: str = ""


# Files a catalog option is sometimes given that a CSV reader would misread as one bad header.
NOT_CSV_SUFFIXES = (".yaml", ".yml", ".json", ".toml", ".xlsx", ".xls", ".parquet")


def require_csv(path: Path, what: str, flag: str, bundled: Path) -> None:
    """A UsageError for a catalog given as YAML, JSON, a spreadsheet...: those read as a CSV
    whose header lacks every column, which named the columns, not the format, as the fault."""
    if Path(path).suffix.lower() in NOT_CSV_SUFFIXES:
        raise UsageError(
            f"{what} {path} is a {Path(path).suffix.lower()} file, and {flag} reads a CSV: "
            f"write it as one with the header of the bundled {bundled}"
        )


def _read_rows(path: Path) -> list[dict[str, str]]:
    require_csv(path, "GPU catalog", "--gpu-catalog", CATALOG_PATH)
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
            if missing and {"provider", "instance"} <= set(reader.fieldnames or []):
                raise UsageError(
                    f"{path} is an instance catalog (provider, instance): give it to "
                    "`gpulens advise --catalog`; --gpu-catalog takes GPUs, with the header of "
                    f"the bundled {CATALOG_PATH}"
                )
            if missing:
                raise UsageError(
                    f"GPU catalog {path} lacks columns {', '.join(missing)}; "
                    f"use the header of the bundled {CATALOG_PATH}"
                )
            return list(reader)
    except OSError as exc:
        raise UsageError(
            f"cannot read GPU catalog {path}: {exc.strerror}; pass an existing CSV to --gpu-catalog"
        ) from exc
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"cannot read GPU catalog {path}: not UTF-8 text (byte {exc.start}); "
            "save it as a UTF-8 CSV"
        ) from None


def _to_float(row: dict, path: Path, column: str) -> float | None:
    value = (row.get(column) or "").strip()
    if value == "":
        return None
    try:
        number = float(value)
    except ValueError as exc:
        raise UsageError(
            f"GPU catalog {path}: column {column} has {value!r}, expected a number or empty"
        ) from exc
    # a negative bandwidth or peak would predict faster than any GPU; no NVLink is 0
    if not math.isfinite(number) or number < 0 or (number == 0 and column != "nvlink_gb_s"):
        raise UsageError(
            f"GPU catalog {path}: {column} of {row['gpu'].strip()} is {value!r}, "
            "expected a positive number or empty"
        )
    return number


def _check_date(row: dict, path: Path) -> None:
    try:
        date.fromisoformat((row.get("date") or "").strip())
    except ValueError:
        raise UsageError(
            f"GPU catalog {path}: date of {row['gpu'].strip()} is {row.get('date')!r}, "
            "expected YYYY-MM-DD"
        ) from None


def _specs(extra: Path | None) -> list[GpuSpec]:
    by_name: dict[str, GpuSpec] = {}
    for path in [CATALOG_PATH] + ([Path(extra)] if extra is not None else []):
        for row in _read_rows(path):
            if not (row.get("gpu") or "").strip():
                raise UsageError(f"GPU catalog {path}: a row has no gpu name; fill the gpu column")
            _check_date(row, path)
            values = {
                f.name: (row.get(f.name) or "").strip()
                if f.name in _TEXT
                else _to_float(row, path, f.name)
                for f in fields(GpuSpec)
            }
            spec = GpuSpec(**values)
            by_name[spec.gpu.lower()] = spec  # a user row overrides the bundled one
    owner: dict[str, str] = {}  # a typed name finds the first GPU it names: it must name one
    for spec in by_name.values():
        for name in {_key(a) for a in [spec.gpu, *spec.aliases.split(";")] if _key(a)}:
            if owner.setdefault(name, spec.gpu) != spec.gpu:
                raise UsageError(
                    f"GPU catalog {extra}: {name!r} names both {owner[name]} and {spec.gpu} "
                    f"(as a name or alias); give each GPU names of its own, or use the name "
                    f"{owner[name]} to override its row"
                )
    return list(by_name.values())


def gpu_catalog(extra: Path | None = None) -> pd.DataFrame:
    """The catalog as a DataFrame (bundled rows, overridden/extended by ``extra``)."""
    return pd.DataFrame([s.__dict__ for s in _specs(extra)], columns=[*COLUMNS, *OPTIONAL_COLUMNS])


def _normalise(name: str) -> str:
    return " ".join(name.lower().replace("-", " ").replace("_", " ").replace("nvidia", " ").split())


def _key(name: str) -> str:
    """A typed name's match key: case, spaces, dashes and underscores don't count."""
    return "".join(_normalise(name).split())


def find_gpu(name: str, extra: Path | None = None, *, recorded: bool = False) -> GpuSpec:
    """The catalog row named ``name`` (its name or an alias, matched whole, so a typo such as
    L40 is an error rather than an L4). ``recorded=True`` reads a run's NVML device name
    ("NVIDIA H100 80GB HBM3"): then the longest alias inside the name wins."""
    specs = _specs(extra)
    wanted = _key(name)
    for spec in specs:
        if wanted in {_key(a) for a in [spec.gpu, *spec.aliases.split(";")] if _key(a)}:
            return spec
    seen, best = _normalise(name), None
    for spec in specs if recorded else ():
        for alias in filter(None, (a.strip() for a in spec.aliases.split(";"))):
            fragment = _normalise(alias)
            if fragment and fragment in seen and (best is None or len(fragment) > best[0]):
                best = (len(fragment), spec)
    if best is None:
        known = ", ".join(s.gpu for s in specs)
        raise UsageError(f"unknown GPU {name!r}; known: {known} (add one with --gpu-catalog FILE)")
    return best[1]


CATALOG_DATE = max(s.date for s in _specs(None))
