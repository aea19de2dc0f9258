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
