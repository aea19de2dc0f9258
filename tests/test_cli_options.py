"""The options of the measuring and predicting commands: no option appears or disappears by
accident, units are in the names, and the old spellings still work (hidden, with a note) for one
release."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer

import gpulens
import gpulens.cli.run as cli_run
import gpulens.colocate.experiment as colocate_runner
import gpulens.stalls as stalls_runner
from gpulens.cli import app, main
from gpulens.cli.common import resolve_target
from gpulens.errors import UsageError

FIXTURES = Path(__file__).parent / "fixtures"
SRC = Path(gpulens.__file__).parent
# A changed list is a changed CLI: update it on purpose, and say so in CHANGELOG.md.
OPTIONS = {
    "run": [
        "--batch-size", "-b", "--steps", "--duration", "--warmup-steps", "--device",
        "--precision", "--workers", "--data", "--until-ci", "--sample-hz",
        "--storage-latency-ms", "--storage-bandwidth-mb-s", "--prep-timing", "--gpus",
        "--nccl-transport", "--ddp-bucket-mb", "--nnodes", "--node-rank", "--master-addr",
        "--master-port", "--worker-affinity", "--skip-bad-samples",
        "--torch-profiler", "--name", "--store", "--no-store", "--inject", "--no-inject",
        "--prometheus-port",
        "--prometheus-host", "--json",
    ],
    "stalls": [
        "--data", "--gpus", "--nnodes", "--node-rank", "--master-addr", "--master-port",
        "--workers", "--batch-size", "-b", "--device", "--precision",
        "--until-ci", "--max-duration", "--time-budget", "--worker-affinity",
        "--storage-latency-ms", "--storage-bandwidth-mb-s", "--fetch-design",
        "--skip-bad-samples", "--store", "--no-store", "--json",
    ],
    "colocate": [
        "--mechanisms", "--mps-thread-pct", "--mps-limit", "--mps-mem-limit", "--priorities",
        "--no-priorities", "--duration", "--warmup-s", "--device", "--max-slowdown", "--plan",
        "--from", "--name", "--store", "--no-store", "--json",
    ],
    "demo": ["--steps", "--device", "--store", "--no-store", "--json"],
    # the GPU catalog is --gpu-catalog in all three; advise's --catalog is the instance catalog
    "predict": [
        "--gpu", "--gpus", "--batch-size", "--workers", "--nodes", "--network-gbps",
        "--gpu-catalog", "--json",
    ],
    "fit": ["--gpu-catalog", "--json"],
    "advise": [
        "--samples", "--epochs", "--dataset-size", "--deadline", "--budget", "--spot",
        "--revocations-per-h", "--checkpoint-s", "--restart-s", "--max-nodes", "--catalog",
        "--gpu-catalog", "--json",
    ],
}  # fmt: skip
# Deprecated spellings: kept, hidden, for one release.
DEPRECATED = {
    "run": ["--warmup", "--storage-bandwidth-mbps"],
    "stalls": ["--storage-bandwidth-mbps"],
    "colocate": ["--warmup"],
    "demo": [],
    "predict": ["--catalog"],
    "fit": ["--catalog"],
    "advise": [],
}


def _params(command: str):
    return typer.main.get_command(app).commands[command].params


@pytest.mark.parametrize("command", sorted(OPTIONS))
def test_option_names_are_the_known_ones(command, capsys):
    shown = [
        name
        for p in _params(command)
        if not getattr(p, "hidden", False)
        for name in (*p.opts, *p.secondary_opts)
        if name.startswith("-")
    ]
    assert shown == OPTIONS[command]
    hidden = [name for p in _params(command) if getattr(p, "hidden", False) for name in p.opts]
    assert hidden == DEPRECATED[command]
    assert main([command, "--help"]) == 0
    help_text = capsys.readouterr().out
    for name in OPTIONS[command]:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", help_text), name
    for name in DEPRECATED[command]:
        assert not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", help_text), name


def test_warmup_and_bandwidth_carry_their_units():
    for command in OPTIONS:
        for name in OPTIONS[command]:
            if "warmup" in name:
                assert name in ("--warmup-steps", "--warmup-s"), name
            if "bandwidth" in name:
                assert name.endswith("-mb-s"), name


# ------------------------------------------------------------------ the deprecated spellings
@pytest.fixture
def run_configs(monkeypatch):
    configs = []
    monkeypatch.setattr(cli_run, "train_and_store", lambda config, *a, **k: configs.append(config))
    monkeypatch.setattr(cli_run, "show_training", lambda *a, **k: None)
    return configs


def test_run_old_and_new_spellings_mean_the_same(run_configs, capsys, tmp_path):
    new = ["run", "tiny_cnn", "--warmup-steps", "3", "--storage-bandwidth-mb-s", "50"]
    old = ["run", "tiny_cnn", "--warmup", "3", "--storage-bandwidth-mbps", "50"]
    data = ["--data", str(tmp_path), "--no-store"]
    assert main([*new, *data]) == 0, capsys.readouterr().err
    assert "deprecated" not in capsys.readouterr().err
    assert main([*old, *data]) == 0
    notes = capsys.readouterr().err.strip().splitlines()
    assert len(notes) == 2
    assert "--warmup is deprecated" in notes[0] and "--warmup-steps" in notes[0]
    assert "--storage-bandwidth-mbps is deprecated" in notes[1]
    assert "--storage-bandwidth-mb-s" in notes[1]
    first, second = run_configs
    assert first.warmup_steps == second.warmup_steps == 3
    assert first.storage_bandwidth_bytes_per_s == second.storage_bandwidth_bytes_per_s == 50e6


def test_old_and_new_spelling_together_is_a_usage_error(run_configs, capsys):
    code = main(["run", "tiny_cnn", "--warmup", "3", "--warmup-steps", "2", "--no-store"])
    assert code == 2 and not run_configs
    assert "give --warmup-steps only" in capsys.readouterr().err


def test_old_spellings_apply_to_built_in_workloads_only(capsys):
    code = main(["run", "--warmup", "3", "--no-store", "--", "python", "x.py"])
    assert code == 2
    assert "--warmup applies to built-in workloads only" in capsys.readouterr().err


def test_predict_gpu_catalog_old_and_new_spellings_mean_the_same(capsys, tmp_path):
    """`predict --gpu-catalog` names the GPU catalog as `advise` does; `--catalog` still works,
    hidden, with a note."""
    run = FIXTURES / "predict_resnet18_b128" / "h100" / "20261125-235354-13e736"
    gpus = tmp_path / "gpus.csv"
    bundled = (SRC / "predict" / "gpus.csv").read_text().splitlines()
    h200 = next(line for line in bundled if line.startswith("H200,"))
    gpus.write_text("\n".join([bundled[0], h200.replace("H200,h200;h200 sxm,", "H201,,")]))
    docs = []
    for flag in ("--gpu-catalog", "--catalog"):
        code = main(["predict", str(run), "--gpu", "H201", flag, str(gpus), "--json"])
        out = capsys.readouterr()
        assert code == 0, out.err
        docs.append(json.loads(out.out))
        deprecated = "--catalog is deprecated" in out.err and "--gpu-catalog" in out.err
        assert deprecated == (flag == "--catalog")
    assert docs[0] == docs[1] and docs[0]["target_gpu"] == "H201"
    code = main(["predict", str(run), "--gpu", "H201", "--catalog", str(gpus),
                 "--gpu-catalog", str(gpus)])  # fmt: skip
    assert code == 2 and "give --gpu-catalog only" in capsys.readouterr().err
    # the GPU catalog's own messages name the new spelling
    assert main(["predict", str(run), "--gpu", "H201"]) == 2
    assert "add one with --gpu-catalog FILE" in capsys.readouterr().err


class _StallsResult:
    runs = {"ingestion_free": None}
    all_runs: dict = {}

    def as_dict(self):
        return {"breakdown_pct": {}}


def test_stalls_bandwidth_alias(monkeypatch, tmp_path, capsys):
    configs = []

    def fake_run_stalls(config, runs_root, progress=None, on_step=None, budget=None):
        configs.append(config)
        return _StallsResult()

    monkeypatch.setattr(stalls_runner, "run_stalls", fake_run_stalls)
    base = ["stalls", "tiny_cnn", "--data", str(tmp_path), "--no-store", "--json"]
    assert main([*base, "--storage-bandwidth-mb-s", "20"]) == 0
    assert "deprecated" not in capsys.readouterr().err
    assert main([*base, "--storage-bandwidth-mbps", "20"]) == 0
    assert "--storage-bandwidth-mbps is deprecated" in capsys.readouterr().err
    assert [c.storage_bandwidth_bytes_per_s for c in configs] == [20e6, 20e6]


def test_colocate_warmup_alias(monkeypatch, capsys):
    configs = []

    def fake_run_colocate(config, runs_root, progress=None):
        configs.append(config)
        return {"jobs": [], "results": []}

    monkeypatch.setattr(colocate_runner, "run_colocate", fake_run_colocate)
    base = ["colocate", "tiny_cnn", "tiny_cnn", "--no-store", "--json"]
    assert main(base) == 0
    assert main([*base, "--warmup-s", "0.5"]) == 0
    assert "deprecated" not in capsys.readouterr().err
    assert main([*base, "--warmup", "0.5"]) == 0
    assert "--warmup is deprecated" in capsys.readouterr().err
    assert [c.warmup_s for c in configs] == [3.0, 0.5, 0.5]


# ------------------------------------------------------------- workload or command: one rule
def test_resolve_target_one_rule():
    assert resolve_target(["tiny_cnn"]).workload == "tiny_cnn"
    assert resolve_target(["python", "x.py"]).command == ("python", "x.py")
    assert resolve_target(["python"]).command == ("python",)  # a program on PATH
    with pytest.raises(UsageError, match="unknown workload 'nope'"):
        resolve_target(["nope"])
    with pytest.raises(UsageError, match="not both"):
        resolve_target(["tiny_cnn", "python", "x.py"])
    with pytest.raises(UsageError, match="command after --"):
        resolve_target([])


@pytest.mark.parametrize("command", ["run", "stalls"])
def test_run_and_stalls_decide_alike(command, tmp_path, capsys):
    extra = ["--data", str(tmp_path)] if command == "stalls" else []
    assert main([command, *extra, "tiny_cnn", "--", "python", "x.py"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main([command, *extra, "--", "tiny_cnn"]) == 2
    assert "is a built-in workload, not a program" in capsys.readouterr().err
    assert main([command, *extra, "nope"]) == 2
    assert "unknown workload 'nope'" in capsys.readouterr().err
