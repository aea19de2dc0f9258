"""The bundled, dated catalog of cloud GPU instances (prices, shapes), extendable with a user CSV.

Each row names a GPU of the GPU catalog (:mod:`gpulens.predict.catalog`), so a configuration can
be predicted; a row whose figure could not be checked says so in ``note``. Spot revocation rates
are rarely published: an empty ``revocations_per_h`` means ``DEFAULT_REVOCATIONS_PER_H`` (or the
user's ``--revocations-per-h``).
"""

from __future__ import annotations

import csv
import logging
import math
from dataclasses import asdict, dataclass
from datetime import date, timedelta
from pathlib import Path

import pandas as pd

from gpulens.errors import UsageError
from gpulens.predict.catalog import find_gpu, require_csv
from gpulens.predict.catalog import gpu_catalog as read_gpu_catalog

log = logging.getLogger(__name__)

INSTANCES_PATH = Path(__file__).with_name("instances.csv")
COLUMNS = (
    "provider", "instance", "gpu", "gpus", "vcpus", "ram_gb", "network_gbps",
    "ondemand_usd_per_h", "spot_usd_per_h", "revocations_per_h", "region", "price_date",
    "source", "note",
)  # fmt: skip
# One revocation per 20 hours of spot time: an assumption (preemptible GPU servers in CM-DARE's
# study lived hours to a day; GCP ends preemptible VMs within 24 h), not a measurement.
DEFAULT_REVOCATIONS_PER_H = 0.05
STALE_AFTER_DAYS = 90


@dataclass(frozen=True)
class Instance:
    """One catalog row; ``gpu`` is the GPU catalog's canonical name."""

    provider: str
    instance: str
    gpu: str
    gpus: int
    vcpus: int
    ram_gb: float
    network_gbps: float | None
    ondemand_usd_per_h: float
    spot_usd_per_h: float | None
    revocations_per_h: float | None
    region: str
    price_date: str
    source: str
    note: str


def _number(row: dict, column: str, path: Path, required: bool) -> float | None:
    text = (row.get(column) or "").strip()
    if not text:
        if required:
            raise UsageError(
                f"instance catalog {path}: {row.get('instance') or 'a row'} has no {column}; "
                "fill it in"
            )
        return None
    try:
        value = float(text)
    except ValueError:
        raise UsageError(
            f"instance catalog {path}: {column} of {row.get('instance')} is {text!r}, "
            "expected a number"
        ) from None
    if (
        not math.isfinite(value)
        or value < 0
        or (required and value == 0 and column != "network_gbps")
    ):
        raise UsageError(
            f"instance catalog {path}: {column} of {row.get('instance')} is {text!r}, "
            "expected a positive number"
        )
    return value


def _parse(row: dict, path: Path, gpu_catalog: Path | None) -> Instance:
    name = (row.get("instance") or "").strip()
    if not name or not (row.get("provider") or "").strip():
        raise UsageError(f"instance catalog {path}: a row lacks provider or instance; fill both")
    try:
        gpu = find_gpu((row.get("gpu") or "").strip() or "?", gpu_catalog).gpu
    except UsageError:
        raise UsageError(
            f"instance catalog {path}: {name} names unknown GPU {row.get('gpu')!r}; use a GPU "
            "catalog name (e.g. H100-SXM, A100-80GB) or add the GPU with --gpu-catalog FILE"
        ) from None
    price_date = (row.get("price_date") or "").strip()
    try:
        day = date.fromisoformat(price_date)
    except ValueError:
        raise UsageError(
            f"instance catalog {path}: price_date of {name} is {price_date!r}, expected YYYY-MM-DD"
        ) from None
    # a user's row dated ahead (a typo) would pass for the freshest price and hide stale ones;
    # a day's slack for time zones (the bundled catalog is not checked: a machine's clock may lag)
    if path != INSTANCES_PATH and day > date.today() + timedelta(days=1):
        raise UsageError(
            f"instance catalog {path}: price_date of {name} is {price_date}, after today "
            f"({date.today().isoformat()}); give the day the price was read"
        )
    gpus = _number(row, "gpus", path, True)
    if gpus is None or gpus != int(gpus):
        raise UsageError(f"instance catalog {path}: gpus of {name} must be a whole number")
    return Instance(
        provider=row["provider"].strip().lower(),
        instance=name,
        gpu=gpu,
        gpus=int(gpus),
        vcpus=int(_number(row, "vcpus", path, True) or 0),
        ram_gb=_number(row, "ram_gb", path, True) or 0.0,
        network_gbps=_number(row, "network_gbps", path, False),
        ondemand_usd_per_h=_number(row, "ondemand_usd_per_h", path, True) or 0.0,
        spot_usd_per_h=_number(row, "spot_usd_per_h", path, False),
        revocations_per_h=_number(row, "revocations_per_h", path, False),
        region=(row.get("region") or "").strip(),
        price_date=price_date,
        source=(row.get("source") or "").strip(),
        note=(row.get("note") or "").strip(),
    )


# A row is found by these; a user row of an instance already in the catalog may give only the
# columns it changes, a new instance needs REQUIRED.
KEY_COLUMNS = ("provider", "instance")
REQUIRED = tuple(c for c in COLUMNS if c not in ("note", "revocations_per_h", "source"))


def _rows(path: Path, required: tuple[str, ...] = REQUIRED) -> list[tuple[int, dict]]:
    """The rows of ``path``, each with the line of the file it ends on."""
    require_csv(path, "instance catalog", "--catalog", INSTANCES_PATH)
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            missing = [c for c in required if c not in (reader.fieldnames or [])]
            if missing and {"gpu", "fp32_tflops"} <= set(reader.fieldnames or []):
                raise UsageError(
                    f"{path} is a GPU catalog (gpu, fp32_tflops, ...): give it with "
                    "--gpu-catalog; --catalog takes instances, with the header of the bundled "
                    f"{INSTANCES_PATH}"
                )
            if missing:
                what = (
                    "a row names its provider and instance, then the columns it changes"
                    if required == KEY_COLUMNS
                    else f"use the header of the bundled {INSTANCES_PATH}"
                )
                raise UsageError(
                    f"instance catalog {path} lacks columns {', '.join(missing)}; {what}"
                )
            return [(reader.line_num, row) for row in reader]
    except OSError as exc:
        raise UsageError(
            f"cannot read instance catalog {path}: {exc.strerror}; pass an existing CSV "
            "to --catalog"
        ) from exc
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"cannot read instance catalog {path}: not UTF-8 text (byte {exc.start}); "
            "save it as a UTF-8 CSV"
        ) from None


def _key(row: dict) -> tuple[str, str]:
    return (row.get("provider") or "").strip().lower(), (row.get("instance") or "").strip()


def _as_row(inst: Instance) -> dict[str, str]:
    """An instance as the CSV row it was read from."""
    return {k: "" if v is None else str(v) for k, v in asdict(inst).items()}


def load_instances(
    extra: Path | None = None,
    gpu_catalog: Path | None = None,
    warnings: list[str] | None = None,
) -> list[Instance]:
    """The bundled rows, extended (or overridden by provider and instance) by ``extra``, whose
    rows of instances already in the catalog may give only the columns they change.
    ``warnings`` gets one line per row of ``extra`` that is allowed but likely a mistake (a
    spot price above on-demand: it happens in real markets, rarely)."""
    read_gpu_catalog(gpu_catalog)  # its own error first, not as every row's "unknown GPU"
    by_key: dict[tuple[str, str], Instance] = {}
    for path in [INSTANCES_PATH] + ([Path(extra)] if extra is not None else []):
        seen: set[tuple[str, str]] = set()  # one row per instance in a file: no silent pick
        for line, row in _rows(path, REQUIRED if path == INSTANCES_PATH else KEY_COLUMNS):
            if _key(row) in seen:
                raise UsageError(
                    f"instance catalog {path}: {':'.join(_key(row))} is on more than one row; "
                    "keep one row per provider and instance"
                )
            seen.add(_key(row))
            known = by_key.get(_key(row))
            if known is not None:  # the columns given override the catalog's row
                row = {**_as_row(known), **{k: v for k, v in row.items() if k in COLUMNS}}
            missing = [c for c in REQUIRED if c not in row]
            if missing:
                provider, name = _key(row)
                raise UsageError(
                    f"instance catalog {path}: {provider}:{name} is not in the bundled catalog, "
                    f"so its row needs columns {', '.join(missing)}; add them (the header of "
                    f"the bundled {INSTANCES_PATH})"
                )
            inst = _parse(row, path, gpu_catalog)
            by_key[(inst.provider, inst.instance)] = inst
            if warnings is not None and path != INSTANCES_PATH:
                warnings += [w for w in [spot_above_ondemand(inst, path, line)] if w]
    return list(by_key.values())


def spot_above_ondemand(inst: Instance, path: Path, line: int) -> str | None:
    """A warning naming the row when its spot price is above its on-demand price; None else."""
    spot, ondemand = inst.spot_usd_per_h, inst.ondemand_usd_per_h
    if spot is None or spot <= ondemand:
        return None
    return (
        f"instance catalog {path}, line {line} ({inst.provider}:{inst.instance}): spot "
        f"{spot:g} USD/h is above on-demand {ondemand:g} USD/h; kept as given (spot rarely "
        "costs more: check the row)"
    )


def instances_frame(instances: list[Instance]) -> pd.DataFrame:
    return pd.DataFrame([asdict(i) for i in instances], columns=list(COLUMNS))


def catalog_date(instances: list[Instance]) -> str:
    """The newest price date: the catalog is as old as its freshest update."""
    return max(i.price_date for i in instances)


def stale_warning(
    catalog_day: str,
    today: date | None = None,
    subject: str = "the instance catalog",
    newest_day: str | None = None,
) -> str | None:
    """A warning when ``subject`` (the catalog, or one instance's price, then with the
    catalog's ``newest_day``) is older than ``STALE_AFTER_DAYS``; None otherwise."""
    age = ((today or date.today()) - date.fromisoformat(catalog_day)).days
    if age <= STALE_AFTER_DAYS:
        return None
    newest = f"; the catalog's newest are of {newest_day}" if newest_day else ""
    return (
        f"{subject} is {age} days old (prices of {catalog_day}{newest}): check current prices "
        "and pass them with --catalog FILE"
    )


def gpu_hour_price(name: str, spot: bool = False) -> dict:
    """One GPU's share of a catalog instance's price per hour (``provider:instance`` or an
    instance name alone when it is unique): what a server on one of its GPUs costs. A dict with
    ``usd_per_gpu_hour`` and where it came from; a UsageError naming the choices else."""
    instances = load_instances()
    provider, _, inst = name.rpartition(":")
    found = [i for i in instances if i.instance == inst and provider in ("", i.provider)]
    if len(found) != 1:
        what = "matches several instances" if found else "is not in the instance catalog"
        choices = ", ".join(sorted(f"{i.provider}:{i.instance}" for i in instances)[:8])
        raise UsageError(f"--instance {name} {what}: give PROVIDER:INSTANCE, e.g. {choices}, ...")
    i = found[0]
    price = i.spot_usd_per_h if spot else i.ondemand_usd_per_h
    if price is None:
        raise UsageError(f"--instance {name}: the catalog has no spot price for it")
    return {
        "provider": i.provider,
        "instance": i.instance,
        "gpu": i.gpu,
        "gpus": i.gpus,
        "pricing": "spot" if spot else "on-demand",
        "instance_usd_per_h": price,
        "usd_per_gpu_hour": round(price / i.gpus, 6),
        "price_date": i.price_date,
        "region": i.region,
        "source": i.source,
        "note": i.note,
    }
