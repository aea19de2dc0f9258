"""A script's own tracked run is made and ended by measured_run: with ``with``, with an explicit
``close()``, or with neither (the run still ends when the script exits, as what happened)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import gpulens
tracker = gpulens.track(name="t", store=False, warmup_steps=1)
for x in tracker.data([[1, 2]] * 6):
    tracker.step()
{ending}
"""


def _run(tmp_path: Path, ending: str) -> tuple[subprocess.CompletedProcess, dict]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(ending=textwrap.dedent(ending)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULENS_", "MLFLOW_"))}
    env.update(GPULENS_HOME=str(tmp_path / "home"), PYTHONPATH=str(REPO / "src"))
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    (run_json,) = (tmp_path / "home" / "runs").glob("*/run.json")
    return done, json.loads(run_json.read_text())


@pytest.mark.parametrize("ending", ["tracker.close()", ""])
def test_a_tracked_script_ends_its_run_finished_with_or_without_close(tmp_path, ending):
    done, meta = _run(tmp_path, ending)
    assert done.returncode == 0, done.stderr
    assert meta["status"] == "finished" and meta["error"] is None
    assert meta["kind"] == "script" and meta["environment"]  # captured by measured_run
    assert meta["summary"]["steps_total"] == 6
    # what gpulens itself spent on the training thread is recorded, as for `gpulens run`
    assert 0 < meta["summary"]["tracking_us_per_step"] < 10_000


def test_a_script_that_dies_unclosed_leaves_a_failed_run_naming_the_error(tmp_path):
    done, meta = _run(tmp_path, "raise SystemError('the loss went NaN')")
    assert done.returncode == 1
    assert meta["status"] == "failed" and "the loss went NaN" in meta["error"]
