"""``gpulens fit``: a CM-DARE-style regression of step time over the store's runs.

Features (log scale, so that the model is a power law like a roofline): the model's FLOPs per
sample, parameters and layers, the batch size, the GPU's peak FLOP/s at the run's precision and
its memory bandwidth, the number of GPUs (workers), and the bytes per element of the precision.
The target is the non-data time of a step (compute + all-reduce + bookkeeping): the data pipeline
depends on the host, not the GPU, and ``predict`` models it apart. Ridge least squares (numpy
only); the error is always measured on held-out runs: leave one workload out when the store has
three or more workloads, else k-fold.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from gpulens.errors import UsageError
from gpulens.paths import gpulens_home
from gpulens.predict import roofline
from gpulens.predict.catalog import GpuSpec, find_gpu
from gpulens.predict.features import PRECISION_BYTES, RunFacts, model_size, run_facts

log = logging.getLogger(__name__)

FEATURES = (
    "log_flops_per_sample",
    "log_params",
    "log_layers",
    "log_batch_size",
    "log_peak_flops",
    "log_bandwidth",
    "log_gpus",
    "precision_bytes",
)
MIN_RUNS = 8
RIDGE = 1e-3
MODEL_FILE = "predict_fit.json"


def model_path(home: Path | None = None) -> Path:
    return Path(home or gpulens_home()) / "models" / MODEL_FILE


def features(facts: RunFacts, spec: GpuSpec) -> dict[str, float] | None:
    """The feature row of ``facts`` as if run on ``spec``; None where a feature is unknown."""
    params, layers = model_size(facts.workload)
    column = roofline.peak_column(facts.precision, facts.workload)
    peak = getattr(spec, column, None)
    if not facts.flops_per_sample or not params or not layers or not peak or not spec.mem_bw_gb_s:
        return None
    return {
        "log_flops_per_sample": math.log(facts.flops_per_sample),
        "log_params": math.log(params),
        "log_layers": math.log(layers),
        "log_batch_size": math.log(facts.batch_size),
        "log_peak_flops": math.log(peak * 1e12),
        "log_bandwidth": math.log(spec.mem_bw_gb_s * 1e9),
        "log_gpus": math.log(facts.gpus),
        "precision_bytes": PRECISION_BYTES.get(facts.precision, 4.0),
    }


@dataclass(frozen=True)
class FitModel:
    """A fitted model: ``log(non-data step s) = intercept + coef . (x - mean) / scale``."""

    features: tuple[str, ...]
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    coef: tuple[float, ...]
    intercept: float
    heldout_mape_pct: float
    validation: str  # "leave-one-workload-out" or "k-fold (k=N)"
    runs: int
    workloads: tuple[str, ...]
    gpus: tuple[str, ...]
    trained_at: str

    @property
    def across_gpus(self) -> bool:
        """Whether it saw more than one GPU model (else it says nothing about a GPU swap)."""
        return len(self.gpus) >= 2

    def predict_s(self, facts: RunFacts, spec: GpuSpec) -> float | None:
        row = features(facts, spec)
        if row is None:
            return None
        x = (np.array([row[f] for f in self.features]) - self.mean) / np.array(self.scale)
        return float(math.exp(self.intercept + float(x @ np.array(self.coef))))

    def as_dict(self) -> dict:
        return {**asdict(self), "across_gpus": self.across_gpus}


def _solve(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    # a constant feature (one GPU, one precision) gets no weight; "constant" up to rounding:
    # log peaks of the H100 and H200 (equal) came out 7e-15 apart, and divided by that spread
    # they became a feature of rounding noise (and a GPU of another peak, a huge one)
    scale[scale <= 1e-9 * np.maximum(1.0, np.abs(mean))] = 1.0
    z = (x - mean) / scale
    intercept = float(y.mean())
    coef = np.linalg.solve(z.T @ z + RIDGE * len(y) * np.eye(z.shape[1]), z.T @ (y - intercept))
    return mean, scale, coef, intercept


def _predict(fitted, x: np.ndarray) -> np.ndarray:
    mean, scale, coef, intercept = fitted
    return np.exp(intercept + ((x - mean) / scale) @ coef)


def _folds(groups: list[str]) -> tuple[list[np.ndarray], str]:
    n = len(groups)
    names = sorted(set(groups))
    if len(names) >= 3:
        return [np.array([g == name for g in groups]) for name in names], "leave-one-workload-out"
    k = min(5, n)
    order = np.random.default_rng(0).permutation(n)
    return [np.isin(np.arange(n), order[i::k]) for i in range(k)], f"k-fold (k={k})"


def training_rows(records, catalog: Path | None = None) -> tuple[list[RunFacts], list[GpuSpec]]:
    """The finished training runs of ``records`` that have every feature."""
    rows: list[RunFacts] = []
    specs: list[GpuSpec] = []
    for rec in records:
        if rec.status != "finished":
            continue
        try:
            facts = run_facts(rec)
            spec = find_gpu(facts.gpu_name, catalog, recorded=True)
        except UsageError:
            continue
        if features(facts, spec) is not None and facts.non_data_s > 0:
            rows.append(facts)
            specs.append(spec)
    return rows, specs


def fit_runs(records, catalog: Path | None = None) -> FitModel:
    """Fit on ``records`` (RunRecords), the held-out error from leave-one-workload-out or
    k-fold. UsageError naming how many runs are needed when there are too few."""
    rows, specs = training_rows(records, catalog)
    if len(rows) < MIN_RUNS:
        raise UsageError(
            f"gpulens fit needs at least {MIN_RUNS} finished training runs measured on a GPU of "
            f"built-in workloads; the store has {len(rows)}: measure more with `gpulens run "
            "WORKLOAD --batch-size B` (several workloads and batch sizes, on each GPU)"
        )
    x = np.array([[features(f, s)[k] for k in FEATURES] for f, s in zip(rows, specs, strict=True)])
    y = np.log(np.array([f.non_data_s for f in rows]))
    groups = [str(f.workload) for f in rows]
    folds, how = _folds(groups)
    errors = []
    for held in folds:
        if held.all() or not held.any():
            continue
        fitted = _solve(x[~held], y[~held])
        predicted = _predict(fitted, x[held])
        errors += list(np.abs(predicted - np.exp(y[held])) / np.exp(y[held]) * 100)
    mean, scale, coef, intercept = _solve(x, y)
    return FitModel(
        features=FEATURES,
        mean=tuple(map(float, mean)),
        scale=tuple(map(float, scale)),
        coef=tuple(map(float, coef)),
        intercept=intercept,
        heldout_mape_pct=float(np.mean(errors)),
        validation=how,
        runs=len(rows),
        workloads=tuple(sorted(set(groups))),
        gpus=tuple(sorted({s.gpu for s in specs})),
        trained_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def save_model(model: FitModel, home: Path | None = None) -> Path:
    """Write the model as JSON under the gpulens home (atomically: a reader never sees half)."""
    path = model_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".fit.", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(model.as_dict(), handle, indent=1)
    os.replace(tmp, path)
    return path


def load_model(home: Path | None = None) -> FitModel | None:
    """The saved model, or None when there is none (or it cannot be read: then say so)."""
    path = model_path(home)
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        raw.pop("across_gpus", None)
        model = FitModel(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    except (OSError, ValueError, TypeError) as exc:
        log.warning("ignoring the fitted model %s (%s): run `gpulens fit` again", path, exc)
        return None
    if model.features != FEATURES:
        log.warning("the fitted model %s has other features: run `gpulens fit` again", path)
        return None
    return model
