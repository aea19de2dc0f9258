"""gpulens: measure deep-learning workloads on GPUs and turn the numbers into decisions."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "load_runs", "load_series", "track"]


def load_runs(home=None):
    """All runs in the local store as a pandas DataFrame, one row per run."""
    from gpulens.store.queries import load_runs as _load_runs

    return _load_runs(home)


def load_series(run_id: str, series: str = "gpu", home=None):
    """One time series (``gpu``, ``host`` or ``steps``) of a run as a pandas DataFrame."""
    from gpulens.store.queries import load_series as _load_series

    return _load_series(run_id, series, home)


def track(*args, **kwargs):
    """Start tracking the calling script; see :class:`gpulens.workloads.tracking.Tracker`."""
    from gpulens.workloads.tracking import track as _track

    return _track(*args, **kwargs)
