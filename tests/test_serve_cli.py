"""`gpulens serve` on the command line: its config checks, the lean install's one line, the
--json document, ending on SIGTERM or Ctrl-C as a finished run, and the served models."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulens.errors import UsageError
from gpulens.serve.config import ModelEntry, ServeConfig

ROOT = Path(__file__).resolve().parents[1]


def config(**kw) -> ServeConfig:
    return ServeConfig(models=(ModelEntry.parse("identity"),), **kw)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"max_batch": -1}, "--max-batch must be >= 0"),
        ({"max_queue_delay_ms": -2}, "--max-queue-delay-ms must be >= 0"),
        ({"instances": 0}, "--instances must be >= 1"),
        ({"precision": "int8"}, "--precision 'int8': use one of auto, fp32, bf16, fp16"),
        ({"port": 70000}, "--port must be in 0..65535"),
        ({"max_queue": 0}, "--max-queue must be >= 1"),
        ({"max_body_mb": 0}, "--max-body-mb must be > 0"),
        ({"duration_s": 0}, "--duration must be > 0"),
        ({"duration_s": float("inf")}, "--duration must be > 0"),
        ({"max_queue_delay_ms": float("nan")}, "--max-queue-delay-ms must be >= 0"),
        ({"max_queue_delay_ms": float("inf")}, "--max-queue-delay-ms must be >= 0"),
        ({"max_body_mb": float("inf")}, "--max-body-mb must be > 0"),
        ({"sample_hz": float("inf")}, "--sample-hz must be > 0"),
    ],
)
def test_config_errors_name_the_option(kw, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(**kw)


def test_models_and_names():
    assert ModelEntry.parse("a=resnet50") == ModelEntry("a", "resnet50")
    assert ModelEntry.parse("bert-base") == ModelEntry("bert-base", "bert-base")
    with pytest.raises(UsageError, match="given twice"):
        ServeConfig(models=(ModelEntry.parse("identity"), ModelEntry.parse("identity")))
    twice = (ModelEntry.parse("a=identity"), ModelEntry.parse("a=tiny_cnn"))
    with pytest.raises(UsageError, match="--model a2=tiny_cnn"):  # was a2=a: no model
        ServeConfig(models=twice)
    with pytest.raises(UsageError, match="at least one --model"):
        ServeConfig(models=())
    with pytest.raises(UsageError, match="NAME=MODEL"):
        ModelEntry.parse("a/b=identity")
    assert config(max_batch=1).batching is False and config().batching is True


def test_the_served_models_and_their_tensors():
    import torch

    from gpulens.serve.models import BertClassifier, get_serve_model

    bert = get_serve_model("bert-base")
    assert bert.inputs[0].metadata() == {"name": "input_ids", "datatype": "INT64",
                                         "shape": [-1, 128]}  # fmt: skip
    assert bert.outputs[0].metadata()["shape"] == [-1, 2]
    small = BertClassifier(vocab=100, seq_len=16, layers=2, hidden=32, heads=4)
    assert small(torch.randint(0, 100, (3, 16))).shape == (3, 2)
    full = BertClassifier()  # BERT-base size: about 110M parameters
    assert 100e6 < sum(p.numel() for p in full.parameters()) < 120e6
    gpt = get_serve_model("gpt2_tiny")
    assert gpt.inputs[0].datatype == "INT64" and gpt.outputs[0].shape == (8192,)
    assert gpt.build()(torch.zeros(2, 256, dtype=torch.long)).shape == (2, 8192)
    assert get_serve_model("resnet50").inputs[0].metadata()["shape"] == [-1, 3, 224, 224]
    with pytest.raises(UsageError, match="unknown model 'nope' for gpulens serve"):
        get_serve_model("nope")


def _gpulens(*args, code: str = "", **kw):
    prog = f"{code}\nimport sys\nfrom gpulens.cli import main\nsys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen([sys.executable, "-c", prog, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)  # fmt: skip


def test_without_the_extra_one_line_names_it_and_exits_2(gpulens_home):
    proc = _gpulens(
        "serve", "--model", "identity", code="import sys; sys.modules['starlette'] = None"
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'gpulens[serve]'" in lines[0]
    assert not (gpulens_home / "runs").exists() or not any((gpulens_home / "runs").iterdir())


def test_the_cli_never_imports_the_web_framework_for_help():
    code = (
        "import sys\nfrom gpulens.cli import app, main\n"
        "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'starlette' not in sys.modules and 'uvicorn' not in sys.modules, 'imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "--max-queue-delay-ms" in out.stdout


def test_a_taken_port_is_a_usage_error_naming_port(gpulens_home):
    pytest.importorskip("starlette")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _gpulens("serve", "--model", "identity", "--device", "cpu", "--port", str(port),
                        "--no-store")  # fmt: skip
        _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "pick another --port" in err


@pytest.mark.parametrize("host", ["192.0.2.1"])  # TEST-NET-1: never this machine
def test_an_address_not_of_this_machine_names_host_not_port(host):
    from gpulens.serve.runner import bind

    with pytest.raises(UsageError, match="--host must be an address") as caught:
        bind(host, 0)
    assert "--port" not in str(caught.value)  # it once said: pick another --port


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_serving(proc, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if "serving" in line:
            return line
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no 'serving' line: {proc.stderr.read()}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "reason"),
    [(None, "duration"), (signal.SIGTERM, "sigterm"), (signal.SIGINT, "interrupt")],
)
def test_a_serving_run_ends_finished_with_one_json_document(gpulens_home, how, reason):
    pytest.importorskip("starlette")
    args = ["serve", "--model", "identity", "--device", "cpu", "--port", "0", "--no-store",
            "--json", "--sample-hz", "2"]  # fmt: skip
    if how is None:
        args += ["--duration", "1.5"]
    # SIGUSR1 dumps every thread's stack: a run that does not end says where it hangs. The
    # child starts with Ctrl-C at its default, as from a terminal: a test run started in the
    # background (`.ci/run &`: SIGINT ignored, inherited) would otherwise make gpulens keep
    # ignoring it, as it should under nohup (test_interrupts), and this case hang.
    proc = _gpulens(*args, code="import faulthandler, signal\n"
                    "faulthandler.register(signal.SIGUSR1, all_threads=True)",
                    preexec_fn=_sigint_default)  # fmt: skip
    line = _wait_serving(proc)
    assert "http://127.0.0.1:" in line
    if how is not None:
        time.sleep(0.5)
        proc.send_signal(how)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
        _out, err = proc.communicate()
        pytest.fail(f"gpulens serve did not end after {how!r}; its threads:\n{err[-6000:]}")
    assert proc.returncode == 0, err
    doc = json.loads(out)  # exactly one JSON document on stdout
    assert doc["status"] == "finished" and doc["stop_reason"] == reason
    assert doc["device"] == "cpu" and doc["requests"] == 0 and "identity" in doc["models"]
    meta = json.loads((Path(doc["record_dir"]) / "run.json").read_text())
    assert meta["kind"] == "serve" and meta["status"] == "finished"
    from gpulens.serve.app import http_implementation  # what served: logged beside the request

    assert meta["effective_config"]["http_server"] == http_implementation()


def test_the_summary_lines_stay_whole_in_80_columns(monkeypatch):
    # piped (80 columns), "... (59.9/s), 0\nfailed, 0 refused (503)" broke mid-sentence
    import io

    from rich.console import Console

    from gpulens.cli import common
    from gpulens.cli import serve as cli_serve

    screen = io.StringIO()
    monkeypatch.setattr(common, "out", Console(file=screen, width=80))
    pcts = {"p50": 0.05, "p99": 4.81}
    doc = {"run_id": "20261128-100821-6b7c8d", "status": "finished", "stop_reason": "interrupt",
           "requests": 309, "served_s": 5.2, "requests_per_s": 59.9, "failures": 0,
           "rejected_503": 0, "record_dir": "/tmp/runs/20261128-100821-6b7c8d",
           "models": {"tiny_cnn": {"requests": 309, "mean_batch_size": 1.08, "queue_ms": pcts,
                                   "compute_ms": pcts, "request_ms": pcts}}}  # fmt: skip
    cli_serve._render(doc)
    lines = screen.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].endswith("0 failed, 0 refused (503)") and lines[1].endswith("4.81 ms")
