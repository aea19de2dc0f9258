"""Secrets on a wrapped command line and in its environment never reach run.json."""

from __future__ import annotations

import json
import sys

import pytest

from gpulens.record.redact import (
    REDACTED,
    is_secret_name,
    redact,
    redact_argv,
    redact_env,
    redact_text,
)
from gpulens.record.writer import RunWriter


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--token=abc"], ["--token=REDACTED"]),
        (["--password", "hunter2", "--lr", "0.1"], ["--password", REDACTED, "--lr", "0.1"]),
        (["--api-key", "k", "--hf_token", "t"], ["--api-key", REDACTED, "--hf_token", REDACTED]),
        (["--client-secret=s"], ["--client-secret=REDACTED"]),
        (["--accessToken", "a"], ["--accessToken", REDACTED]),
        (["HF_TOKEN=abc", "python"], ["HF_TOKEN=REDACTED", "python"]),
        (["WANDB_API_KEY=abc"], ["WANDB_API_KEY=REDACTED"]),
        (["https://user:pw@example.com/x"], ["https://user:REDACTED@example.com/x"]),
        (["--db=postgresql://u:p@h/db"], ["--db=postgresql://u:REDACTED@h/db"]),
        (["http://h/x?access_token=abc&page=2"], ["http://h/x?access_token=REDACTED&page=2"]),
        # not secrets: counts, names, paths, ordinary keys
        (
            ["--max-tokens", "512", "--tokenizer", "gpt2"],
            ["--max-tokens", "512", "--tokenizer", "gpt2"],
        ),
        (["--token-file", "/run/t", "--key", "loss"], ["--token-file", "/run/t", "--key", "loss"]),
        (["--password", "--verbose"], ["--password", "--verbose"]),
        (["https://example.com/x"], ["https://example.com/x"]),
    ],
)
def test_redact_argv(argv, expected):
    assert redact_argv(argv) == expected


def test_redact_text_keeps_the_rest_of_the_command():
    text = "env HF_TOKEN=abc python train.py --token abc --password='a b' --epochs 3"
    assert redact_text(text) == (
        "env HF_TOKEN=REDACTED python train.py --token REDACTED --password=REDACTED --epochs 3"
    )


def test_redact_env_by_name():
    env = {
        "AWS_SECRET_ACCESS_KEY": "s",
        "PGPASSWORD": "p",
        "MLFLOW_TRACKING_TOKEN": "t",
        "MY_SERVICE_KEY": "k",
        "CUDA_VISIBLE_DEVICES": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "SSH_AUTH_SOCK": "/tmp/agent",
        "PWD": "/home/me",
    }
    out = redact_env(env)
    assert {k for k, v in out.items() if v == REDACTED} == {
        "AWS_SECRET_ACCESS_KEY",
        "PGPASSWORD",
        "MLFLOW_TRACKING_TOKEN",
        "MY_SERVICE_KEY",
    }
    assert not is_secret_name("batch_size") and is_secret_name("api_key")


def test_redact_walks_nested_values():
    doc = {
        "jobs": [{"command": ["python", "x.py", "--token", "t"], "key": "cmd:x --token t"}],
        "password": "p",
        "steps": 5,
    }
    out = redact(doc)
    assert out["jobs"][0]["command"] == ["python", "x.py", "--token", REDACTED]
    assert out["jobs"][0]["key"] == "cmd:x --token REDACTED"
    assert out["password"] == REDACTED and out["steps"] == 5


def test_run_writer_redacts_what_it_captures(tmp_path):
    w = RunWriter(
        tmp_path,
        kind="command",
        requested_config={"command": "python t.py --api-key=sk-123", "env": {"HF_TOKEN": "h"}},
    )
    w.update(effective_config={"command": "python t.py --api-key=sk-123"}, summary={"x": 1})
    w.finish("failed", error="python t.py --api-key=sk-123 exited with code 1")
    text = (w.dir / "run.json").read_text()
    assert "sk-123" not in text and '"h"' not in text
    assert "--api-key=REDACTED" in text


def test_wrapped_command_secrets_stay_out_of_the_record(tmp_path, monkeypatch):
    from gpulens.launch.command import run_command

    argv = [
        sys.executable,
        "-c",
        "pass",
        "--token=tok-secret-1",
        "--password",
        "pw-secret-2",
        "--url",
        "https://bob:pw-secret-3@example.com/data",
        "--epochs",
        "2",
    ]
    result = run_command(
        argv, tmp_path / "runs", extra_env={"WANDB_API_KEY": "key-secret-4", "SEED": "1"}
    )
    assert result.status == "finished"
    meta = json.loads((result.record_dir / "run.json").read_text())
    text = json.dumps(meta)
    for secret in ("tok-secret-1", "pw-secret-2", "pw-secret-3", "key-secret-4"):
        assert secret not in text
    command = meta["requested_config"]["command"]
    assert "--epochs 2" in command and "https://bob:REDACTED@example.com/data" in command
    assert meta["requested_config"]["env"] == {"WANDB_API_KEY": REDACTED, "SEED": "1"}
