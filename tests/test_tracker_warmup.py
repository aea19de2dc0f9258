"""A short script's steps: every one is in the record, and the warm-up left out is said.

A script of 3 batches under `gpulens run -- python script.py` (or with gpulens.track()) had
all its steps taken as the fixed 5-step warm-up: 0 measured steps, no throughput, and nothing
said. Now a short script keeps a shorter warm-up, and the summary (and the JSON of `gpulens run
-- CMD`) gives every step, the warm-up ones and why they are fewer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch

from gpulens.record.tracker import read_tracker_summary
from gpulens.workloads.tracking import Tracker


def _steps_series(run_dir) -> pd.DataFrame:
    series = run_dir / "series"
    files = [f for f in sorted(series.rglob("*.parquet")) if f.relative_to(series).parts[0]
             .startswith("steps")]  # fmt: skip
    return pd.concat([pd.read_parquet(f) for f in files]).sort_values("step")


def _track(n_batches: int, **kwargs) -> None:
    model = torch.nn.Linear(4, 2)
    batches = [torch.randn(8, 4) for _ in range(n_batches)]
    with Tracker(**kwargs) as tracker:
        for x in tracker.data(batches):
            model(x).sum().backward()
            tracker.step()


@pytest.mark.parametrize(("n", "warmup"), [(1, 0), (2, 1), (3, 1), (6, 2), (7, 2), (8, 5), (16, 5)])
def test_every_step_of_a_short_script_is_recorded_and_its_warmup_said(parent_run, n, warmup):
    _track(n)
    s = read_tracker_summary(parent_run)
    assert s["steps_total"] == n
    assert s["measured_steps"] == n - warmup  # some measured steps, however short the script
    assert s["warmup_steps"] == warmup
    if n >= 8:  # the usual warm-up: nothing to say
        assert "warmup_note" not in s
    else:
        assert f"({n} steps)" in s["warmup_note"] or "a single step" in s["warmup_note"]
    # the record has every step, flagged as the summary counts them
    df = _steps_series(parent_run)
    assert df["step"].tolist() == list(range(n))
    assert df["warmup"].tolist() == [i < warmup for i in range(n)]


def test_a_warmup_the_script_chose_is_kept(parent_run):
    _track(3, warmup_steps=5)
    s = read_tracker_summary(parent_run)
    assert s["steps_total"] == 3 and s["measured_steps"] == 0 and s["warmup_steps"] == 3
    assert "warmup_note" not in s
    assert _steps_series(parent_run)["warmup"].tolist() == [True] * 3


SHORT = textwrap.dedent("""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.randn(24, 16), torch.randint(0, 4, (24,))),
                        batch_size=8)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
""")


def _gpulens_run(tmp_path, path) -> dict:
    env = {**os.environ, "GPULENS_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "gpulens.cli", "run", "--no-store", "--json", "--",
         sys.executable, str(path)],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_an_unmodified_script_of_three_batches_records_its_three_steps(tmp_path):
    path = tmp_path / "short.py"
    path.write_text(SHORT)
    doc = _gpulens_run(tmp_path, path)
    assert doc["steps_total"] == 3 and doc["warmup_steps"] == 1 and doc["measured_steps"] == 2
    assert "a short script (3 steps)" in doc["warmup_note"]
    assert _steps_series(Path(doc["record_dir"]))["warmup"].tolist() == [True, False, False]


def test_a_script_that_ends_with_os_exit_keeps_its_steps(tmp_path):
    """os._exit skips atexit, where the injected tracker writes the steps: the run had none.
    Its forked loader workers leave through os._exit too, and must not write them."""
    path = tmp_path / "os_exit.py"
    script = SHORT.replace("torch.randn(24, 16)", "torch.randn(128, 16)")
    script = script.replace("(24,)", "(128,)").replace(
        "batch_size=8", "batch_size=8, num_workers=2"
    )
    path.write_text(script + "import os\nos._exit(0)\n")
    doc = _gpulens_run(tmp_path, path)
    assert doc["status"] == "finished"
    assert doc["steps_total"] == 16 and doc["measured_steps"] == 11 and doc["warmup_steps"] == 5
    assert len(_steps_series(Path(doc["record_dir"]))) == 16
