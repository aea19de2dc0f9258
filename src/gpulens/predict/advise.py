"""What to run on: every configuration's time and cost for a job, the Pareto front, and the one
to pick for a deadline or a budget. Pure: works on a throughput table (one row per
configuration, throughput from the predictor) and prints nothing.

Each time is a distribution: p50 is the prediction (on spot, with revocations), p90 adds the
prediction's own error (``p90_error_pct`` of the table, read as normal errors of that mean
absolute size: a lognormal factor of median 1) and, on spot, the revocations' spread."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from gpulens.errors import UsageError
from gpulens.predict.instances import DEFAULT_REVOCATIONS_PER_H
from gpulens.predict.spot import SpotParams, spot_outcome

log = logging.getLogger(__name__)

TABLE_COLUMNS = (
    "provider", "instance", "gpu", "gpus", "nodes", "throughput_samples_per_s",
    "ondemand_usd_per_h", "spot_usd_per_h",
)  # fmt: skip
OPTION_COLUMNS = (
    "provider", "instance", "gpu", "gpus", "nodes", "pricing", "time_h", "cost_usd",
    "time_h_p90", "cost_usd_p90", "pareto", "throughput_samples_per_s", "price_date",
    "checkpoint_interval_h", "revocations_per_h", "validated_error_pct", "beyond_validation",
    "p90_error_pct", "p90_error_basis",
)  # fmt: skip
# A job's size beyond any training run (a mistyped exponent): its spot simulation overflowed
# (--samples 1e25 was an internal error) and its table printed no sense.
MAX_SAMPLES = 1e18
# The node counts --max-nodes adds, up to it.
NODE_COUNTS = (2, 4, 8, 16, 32, 64)
Z_P90 = 1.2815515655446004  # the standard normal's 90th percentile
MAD_TO_SD = math.sqrt(math.pi / 2)  # a normal's sd over its mean absolute deviation


def error_sigma(error_pct: float | None) -> float:
    """The log-sd of a time whose prediction errs ``error_pct`` on average (absolute)."""
    if error_pct is None or pd.isna(error_pct) or error_pct <= 0:
        return 0.0
    return MAD_TO_SD * float(error_pct) / 100.0


def _positive(name: str, value: float | None, flag: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UsageError(f"{flag} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise UsageError(f"{flag} must be finite, got {value!r}")


@dataclass(frozen=True)
class AdviseConfig:
    """What ``gpulens advise`` was asked: the job's size and the constraint(s)."""

    samples: float | None = None
    epochs: float | None = None
    dataset_size: int | None = None
    deadline_h: float | None = None
    budget_usd: float | None = None
    max_nodes: int = 1

    def __post_init__(self) -> None:
        if self.samples is None and self.epochs is None:
            raise UsageError("give the job's size: --samples N, or --epochs E --dataset-size D")
        if self.samples is not None and (self.epochs is not None or self.dataset_size):
            raise UsageError("give either --samples or --epochs with --dataset-size, not both")
        if self.epochs is not None and self.dataset_size is None:
            raise UsageError("--epochs needs the samples per epoch: --dataset-size D")
        _positive("samples", self.samples, "--samples")
        _positive("epochs", self.epochs, "--epochs")
        _positive("dataset_size", self.dataset_size, "--dataset-size")
        _positive("deadline_h", self.deadline_h, "--deadline")
        _positive("budget_usd", self.budget_usd, "--budget")
        if self.total_samples > MAX_SAMPLES:
            raise UsageError(
                f"the job is {self.total_samples:.3g} samples, more than {MAX_SAMPLES:.0e}: "
                "check --samples (or --epochs x --dataset-size)"
            )
        if isinstance(self.max_nodes, bool) or not 1 <= self.max_nodes <= NODE_COUNTS[-1]:
            raise UsageError(
                f"--max-nodes must be a whole number from 1 to {NODE_COUNTS[-1]} (it adds "
                f"{', '.join(map(str, NODE_COUNTS[:3]))}, ... nodes up to it), got {self.max_nodes}"
            )

    @property
    def total_samples(self) -> float:
        if self.samples is not None:
            return float(self.samples)
        return float(self.epochs) * float(self.dataset_size)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Advice:
    options: pd.DataFrame  # OPTION_COLUMNS, fastest first
    recommended: int | None  # a row label of ``options``
    reason: str


def pareto_mask(time_h: np.ndarray, cost_usd: np.ndarray) -> np.ndarray:
    """True where no other point is at least as fast and as cheap, and better in one."""
    t, c = np.asarray(time_h, float), np.asarray(cost_usd, float)
    le = (t[None, :] <= t[:, None]) & (c[None, :] <= c[:, None])
    lt = (t[None, :] < t[:, None]) | (c[None, :] < c[:, None])
    return ~(le & lt).any(axis=1)


def _option_rows(row: pd.Series, samples: float, spot: SpotParams | None) -> list[dict]:
    tput = float(row["throughput_samples_per_s"])
    work_h = samples / tput / 3600.0
    nodes = int(row["nodes"])
    base = {k: row[k] for k in ("provider", "instance", "gpu", "gpus", "nodes")}
    spread_pct = row.get("p90_error_pct")
    sigma = error_sigma(spread_pct)
    base.update(throughput_samples_per_s=tput, price_date=row.get("price_date"),
                validated_error_pct=row.get("validated_error_pct"),
                beyond_validation=row.get("beyond_validation"),
                p90_error_pct=None if sigma == 0 else float(spread_pct),
                p90_error_basis=row.get("p90_error_basis") if sigma else None)  # fmt: skip
    cost = work_h * float(row["ondemand_usd_per_h"]) * nodes
    p90_h = work_h * math.exp(Z_P90 * sigma)
    rows = [dict(base, pricing="on-demand", time_h=work_h, cost_usd=cost, time_h_p90=p90_h,
                 cost_usd_p90=p90_h * float(row["ondemand_usd_per_h"]) * nodes,
                 checkpoint_interval_h=None, revocations_per_h=0.0)]  # fmt: skip
    spot_price = row.get("spot_usd_per_h")
    if spot is None or spot_price is None or pd.isna(spot_price):
        return rows
    rate = spot.revocations_per_h
    if rate is None:
        catalog_rate = row.get("revocations_per_h")
        rate = DEFAULT_REVOCATIONS_PER_H if catalog_rate is None or pd.isna(catalog_rate) else (
            float(catalog_rate))  # fmt: skip
    rate_job = rate * nodes  # any node's revocation stops a data-parallel job
    out = spot_outcome(work_h, spot.checkpoint_s / 3600.0, spot.restart_s / 3600.0, rate_job,
                       spot.samples, spot.seed, sigma)  # fmt: skip
    per_h = float(spot_price) * nodes
    rows.append(dict(base, pricing="spot", time_h=out.time_h_p50, cost_usd=out.time_h_p50 * per_h,
                     time_h_p90=out.time_h_p90, cost_usd_p90=out.time_h_p90 * per_h,
                     checkpoint_interval_h=out.interval_h if math.isfinite(out.interval_h)
                     else None, revocations_per_h=rate_job))  # fmt: skip
    return rows


def _knee(options: pd.DataFrame) -> int:
    """The Pareto point past which 1% faster costs more than 1% more: the least time x cost
    (on log axes, the front's tangent of slope -1). Scaling both axes to the front's ranges
    instead made a front of 63x in time and 10% in cost pick its slowest end."""
    front = options[options["pareto"]].sort_values(["cost_usd", "time_h"])
    product = front["time_h"].to_numpy() * front["cost_usd"].to_numpy()
    best = np.flatnonzero(product <= product.min() * (1 + 1e-9))
    return int(front.index[best[0]])  # on a tie, the cheaper


def _usd(amount: float, other: float | None = None) -> str:
    """Dollars to the cent; an amount given in finer steps (a budget) as given, and one whose
    cents would equal ``other``'s (the budget it misses) to 1/100 cent."""
    cents = f"${amount:,.2f}"
    if other is None:
        return cents if round(amount, 2) == amount else f"${amount:,g}"
    return f"${amount:,.4f}" if cents == f"${other:,.2f}" else cents


def recommend(
    options: pd.DataFrame, deadline_h: float | None, budget_usd: float | None
) -> tuple[int | None, str]:
    """The row to pick and why. Deadlines and budgets are met at p90 (predictions err, spot
    runs vary)."""
    if options.empty:
        return None, "no configuration could be predicted"
    fits = pd.Series(True, index=options.index)
    if deadline_h is not None:
        fits &= options["time_h_p90"] <= deadline_h
    if budget_usd is not None:
        fits &= options["cost_usd_p90"] <= budget_usd
    ok = options[fits]
    fastest = options.sort_values(["time_h", "cost_usd"]).index[0]
    cheapest = options.sort_values(["cost_usd", "time_h"]).index[0]
    if deadline_h is not None:
        in_time = options[options["time_h_p90"] <= deadline_h]
        if ok.empty and not in_time.empty:  # the budget is what nothing meets
            pick = in_time.sort_values(["cost_usd", "time_h"]).index[0]
            cost = options.at[pick, "cost_usd_p90"]
            return int(pick), (
                f"none that finishes within {deadline_h:g} h (p90) stays within "
                f"{_usd(budget_usd)}: the cheapest that does costs {_usd(cost, budget_usd)} "
                "at p90"
            )
        if ok.empty:
            return int(fastest), (
                f"no configuration meets the deadline (at p90); the fastest takes "
                f"{options.at[fastest, 'time_h_p90']:.2f} h at p90"
            )
        pick = ok.sort_values(["cost_usd", "time_h"]).index[0]
        within = " within the budget" if budget_usd is not None else ""
        return int(pick), f"the cheapest that finishes within {deadline_h:g} h (p90){within}"
    if budget_usd is not None:
        if ok.empty:
            cost = options.at[cheapest, "cost_usd_p90"]
            return int(cheapest), (
                f"no configuration stays within {_usd(budget_usd)} (at p90); the cheapest "
                f"costs {_usd(cost, budget_usd)} at p90"
            )
        pick = ok.sort_values(["time_h", "cost_usd"]).index[0]
        return int(pick), f"the fastest that stays within {_usd(budget_usd)} (p90)"
    return _knee(options), (
        "no deadline or budget: the knee of the Pareto front (the least time x cost), past "
        "which 1% faster costs more than 1% more"
    )


def advise(
    table: pd.DataFrame,
    samples: float,
    deadline_h: float | None = None,
    budget_usd: float | None = None,
    spot: SpotParams | None = None,
) -> Advice:
    """Every configuration of ``table`` (``TABLE_COLUMNS``; optional ``price_date``,
    ``revocations_per_h``, and ``p90_error_pct`` with its ``p90_error_basis``) on demand, and
    on spot where it has a spot price and ``spot`` is given; the Pareto front over (time,
    cost) and the recommendation."""
    missing = [c for c in TABLE_COLUMNS if c not in table.columns]
    if missing:
        raise ValueError(f"throughput table lacks {missing}")
    good = table[table["throughput_samples_per_s"] > 0]
    rows = [r for _, row in good.iterrows() for r in _option_rows(row, samples, spot)]
    options = pd.DataFrame(rows, columns=[c for c in OPTION_COLUMNS if c != "pareto"])
    options["pareto"] = pareto_mask(options["time_h"], options["cost_usd"]) if rows else []
    options = options[list(OPTION_COLUMNS)].sort_values(["time_h", "cost_usd"])
    options = options.reset_index(drop=True)
    pick, reason = recommend(options, deadline_h, budget_usd)
    return Advice(options, pick, reason)
