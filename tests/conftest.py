"""Shared fixtures: every test gets its own gpulens home and no MLflow server of the user's."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def gpulens_home(tmp_path, monkeypatch):
    home = tmp_path / "gpulens-home"
    monkeypatch.setenv("GPULENS_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("GPULENS_RUN_DIR", raising=False)
    return home


@pytest.fixture
def parent_run(tmp_path, monkeypatch):
    """A run made by gpulens for the tracker to write into (no monitor of its own: fast)."""
    from gpulens.workloads.tracking import FIRST_PASS_ENV, INGESTION_FREE_ENV

    run_dir = tmp_path / "run"
    (run_dir / "series").mkdir(parents=True)
    monkeypatch.setenv("GPULENS_RUN_DIR", str(run_dir))
    monkeypatch.delenv(INGESTION_FREE_ENV, raising=False)
    monkeypatch.delenv(FIRST_PASS_ENV, raising=False)
    return run_dir
