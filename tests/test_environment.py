"""What the record says the run ran on: torch's facts, read without importing torch where the
process has not imported it (a command run's parent)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpulens.probes import environment


def test_torch_facts_from_files_match_the_imported_module():
    import torch

    from_files = environment.torch_facts_from_files()
    assert from_files == environment.torch_facts_from_module(torch)
    assert from_files["torch"] == torch.__version__


@pytest.mark.parametrize(
    ("wheel_version", "expected"),
    [("9.24.0.43", 92400), ("9.1.0.70", 90100), ("8.9.2.26", 8902), ("not-a-version", None)],
)
def test_cudnn_version_reads_as_torch_gives_it(monkeypatch, wheel_version, expected):
    asked = []

    def version(name):
        asked.append(name)
        return wheel_version

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert environment._pip_cudnn_version("12.4") == expected
    assert asked == ["nvidia-cudnn-cu12"]
    assert environment._pip_cudnn_version(None) is None  # a CPU-only build of torch


def test_without_torch_the_facts_say_none(monkeypatch):
    monkeypatch.setattr(environment.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert environment.torch_facts() == {"torch": None}


@pytest.mark.slow
def test_a_command_run_records_torch_without_importing_it(tmp_path):
    # Importing torch costs the parent seconds before the command starts; it never needs it.
    script = (
        "import sys\n"
        "from gpulens.cli import main\n"
        "code = main(['run', '--no-store', '--json', '--', sys.executable, '-c', 'pass'])\n"
        "assert 'torch' not in sys.modules, 'the parent imported torch'\n"
        "sys.exit(code)\n"
    )
    env = {**os.environ, "GPULENS_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    record = Path(json.loads(done.stdout)["record_dir"])
    facts = json.loads((record / "run.json").read_text())["environment"]
    import torch

    assert facts["torch"] == torch.__version__
    assert facts["cuda_runtime"] == torch.version.cuda
