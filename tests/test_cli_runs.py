"""``gpulens runs ...`` through typer's CliRunner."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from gpulens.cli.runs import runs_app
from gpulens.errors import MissingExtraError, UsageError
from gpulens.record.writer import RunWriter

SCHEMA = pa.schema(
    [("time_unix_s", pa.float64()), ("gpu_index", pa.int32()), ("power_w", pa.float64())]
)
FAST, SLOW, DEAD = "20240201-000001-fa5700", "20240201-000002-510e00", "20240201-000003-dead00"

runner = CliRunner()
# MLflow's own SQLAlchemy use warns about itself; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")


def _finished(runs: Path, run_id: str, name: str, throughput: float) -> None:
    w = RunWriter(runs, kind="train", name=name, run_id=run_id)
    w.update(
        effective_config={"workload": "gpt2_tiny", "batch_size": 8, "device": "cpu"},
        summary={"workload": "gpt2_tiny", "device": "cpu", "throughput_samples_per_s": throughput},
    )
    series = w.series("gpu", SCHEMA)
    t0 = time.time()
    for i in range(10):
        series.append({"time_unix_s": t0 + i, "gpu_index": 0, "power_w": 100.0 + i})
    w.finish()


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("cli_home")
    runs = home / "runs"
    _finished(runs, FAST, "fast", 200.0)
    _finished(runs, SLOW, "slow", 150.0)
    w = RunWriter(runs, kind="command", run_id=DEAD)  # killed: owner gone, status still running
    w._stop.set()
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    w.meta["pid"] = proc.pid
    w.save()
    return home


@pytest.fixture(autouse=True)
def _env(home, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("GPULENS_HOME", str(home))
    db = tmp_path_factory.getbasetemp() / "cli_mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")


def _json(result) -> dict:
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return json.loads(result.stdout)  # exactly one document, nothing else on stdout


def test_list_json_newest_first_and_filters():
    doc = _json(runner.invoke(runs_app, ["list", "--json"]))
    assert [r["run_id"] for r in doc["runs"]] == [DEAD, SLOW, FAST]
    assert doc["total"] == 3
    fast = doc["runs"][2]
    assert fast["status"] == "finished"
    assert fast["workload"] == "gpt2_tiny"
    assert fast["throughput_samples_per_s"] == 200.0
    assert doc["runs"][0]["status"] == "killed"
    doc = _json(runner.invoke(runs_app, ["list", "--json", "--limit", "1"]))
    assert len(doc["runs"]) == 1 and doc["total"] == 3
    doc = _json(runner.invoke(runs_app, ["list", "--json", "--status", "killed"]))
    assert [r["run_id"] for r in doc["runs"]] == [DEAD]


def test_list_table():
    result = runner.invoke(runs_app, ["list"])
    assert result.exit_code == 0
    assert FAST in result.stdout and DEAD in result.stdout


def test_show(home):
    doc = _json(runner.invoke(runs_app, ["show", "20240201-000001", "--json"]))
    assert doc["run_id"] == FAST
    assert doc["effective_config"]["batch_size"] == 8
    assert doc["summary"]["throughput_samples_per_s"] == 200.0
    assert doc["series"][0]["name"] == "gpu" and doc["series"][0]["rows"] == 10
    assert doc["record_dir"] == str(home / "runs" / FAST)
    result = runner.invoke(runs_app, ["show", "latest"])
    assert result.exit_code == 0
    assert "killed" in result.stdout


def test_unknown_and_ambiguous_runs_are_usage_errors():
    result = runner.invoke(runs_app, ["show", "nope"])
    assert isinstance(result.exception, UsageError)
    assert "no run matches 'nope': see `gpulens runs list`" in str(result.exception)
    assert result.exception.exit_code == 2
    result = runner.invoke(runs_app, ["show", "20240201"])
    assert isinstance(result.exception, UsageError)
    assert "matches 3 runs" in str(result.exception)


def test_compare():
    doc = _json(runner.invoke(runs_app, ["compare", FAST, "slow", "--json"]))
    assert doc["run_ids"] == [FAST, SLOW]
    rows = {r["field"]: r for r in doc["rows"]}
    assert rows["throughput_samples_per_s"]["values"] == {FAST: 200.0, SLOW: 150.0}
    assert rows["throughput_samples_per_s"]["rel_diff_pct"] == pytest.approx(-25.0)
    assert rows["config.batch_size"]["rel_diff_pct"] == 0.0
    result = runner.invoke(runs_app, ["compare", FAST, SLOW])
    assert result.exit_code == 0 and "-25.0%" in result.stdout
    result = runner.invoke(runs_app, ["compare", FAST])
    assert isinstance(result.exception, UsageError)
    assert "different kinds" not in runner.invoke(runs_app, ["compare", FAST, SLOW]).stderr
    result = runner.invoke(runs_app, ["compare", FAST, DEAD])  # a train run and a command
    assert result.exit_code == 0
    assert "runs of different kinds (train, command)" in " ".join(result.stderr.split())


def test_export(tmp_path):
    doc = _json(
        runner.invoke(
            runs_app, ["export", FAST, "--out", str(tmp_path / "e"), "--format", "csv", "--json"]
        )
    )
    assert doc == {"run_id": FAST, "format": "csv", "path": str(tmp_path / "e")}
    assert (tmp_path / "e" / "gpu.csv").is_file() and (tmp_path / "e" / "run.json").is_file()
    result = runner.invoke(runs_app, ["export", FAST, "--out", str(tmp_path / "d")])
    assert result.exit_code == 0
    assert (tmp_path / "d" / "series" / "gpu.parquet").is_file()
    result = runner.invoke(runs_app, ["export", FAST, "--out", str(tmp_path / "x"), "-f", "xml"])
    assert isinstance(result.exception, UsageError)


def test_sync_json_then_nothing_left():
    pytest.importorskip("mlflow")
    t0 = time.perf_counter()
    doc = _json(runner.invoke(runs_app, ["sync", "--json"]))
    first_s = time.perf_counter() - t0
    assert {s["run_id"] for s in doc["synced"]} == {FAST, SLOW, DEAD}
    assert doc["failed"] == []
    t0 = time.perf_counter()
    again = _json(runner.invoke(runs_app, ["sync", "--json"]))
    assert again["synced"] == [] and again["failed"] == []
    sys.stderr.write(
        f"\n[mlflow] cli sync: first {first_s:.2f} s, second {time.perf_counter() - t0:.2f} s\n"
    )
    listed = _json(runner.invoke(runs_app, ["list", "--json"]))
    assert all(r["mlflow_run_id"] for r in listed["runs"])
    result = runner.invoke(runs_app, ["sync"])
    assert result.exit_code == 0 and "nothing to sync" in result.stdout


def test_sync_without_mlflow(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` now raises ImportError
    result = runner.invoke(runs_app, ["sync", "--uri", f"sqlite:///{tmp_path / 'none.db'}"])
    assert isinstance(result.exception, MissingExtraError)
    assert "pip install 'gpulens[store]'" in str(result.exception)


def test_numbers_in_tables_read_plainly():
    """A rate never in exponent notation; an interval's bounds at 4 digits, not 16."""
    from gpulens.cli.runs import _fmt, _rate

    assert _rate(13150.4).plain == "13,150" and _rate(7082.0).plain == "7,082"
    assert _rate(49.28).plain == "49.28" and _rate(None).plain == "-"
    assert _fmt([5417.2985061388745, 6302.922270120006]) == "[5417, 6303]"
    assert _fmt({"a": 1}) == '{"a": 1}'


def test_a_long_command_line_leaves_status_and_rate_in_sight(tmp_path, monkeypatch):
    """On an 80-column terminal a wrapped command's long workload cell is cut, not the
    status and samples/s columns (rich had squeezed them to nothing)."""
    import io

    from rich.console import Console

    import gpulens.cli.common as common

    runs = tmp_path / "runs"
    w = RunWriter(runs, kind="command", run_id="20261128-000000-abcdef")
    long = "python examples/train_plain.py --batch-size 32 --model resnet18 --steps 100000"
    w.update(summary={"workload": long, "throughput_samples_per_s": 13150.4})
    w.finish()
    monkeypatch.setenv("GPULENS_HOME", str(tmp_path))
    buf = io.StringIO()
    monkeypatch.setattr(common, "out", Console(file=buf, width=80))
    result = runner.invoke(runs_app, ["list"])
    assert result.exit_code == 0, result.output
    text = buf.getvalue()
    assert "status" in text and "samples/s" in text and "finished" in text
    assert "13,150" in text and all(len(line) <= 80 for line in text.splitlines())


def _list_text(monkeypatch, width: int, *args: str) -> str:
    import io

    from rich.console import Console

    import gpulens.cli.common as common

    buf = io.StringIO()
    monkeypatch.setattr(common, "out", Console(file=buf, width=width))
    result = runner.invoke(runs_app, ["list", *args])
    assert result.exit_code == 0, result.output
    return buf.getvalue()


def test_list_shows_a_script_label_whole_in_80_and_120_columns(tmp_path, monkeypatch):
    """`runs list` at 80 columns cut `train_tracked.py` to `train_tracked.…`: the workload
    column now gets the width the other columns' cells leave (a longer label folds, whole);
    at 120 columns the other columns come back, each line within the width."""
    runs = tmp_path / "runs"
    commands = {
        "20261201-100001-aaaaaa": "/work/main/.venv/bin/python examples/train_tracked.py -e 5",
        "20261201-100002-bbbbbb": "python -m pkg.train_transformer --lr 0.1",
    }
    for run_id, command in commands.items():
        w = RunWriter(runs, kind="command", name="resnet50-cuda-b64", run_id=run_id)
        w.update(summary={"workload": command, "throughput_samples_per_s": 13150.4})
        w.finish()
    monkeypatch.setenv("GPULENS_HOME", str(tmp_path))
    for width in (80, 120):
        text = _list_text(monkeypatch, width)
        lines = text.splitlines()
        assert all(len(line) <= width for line in lines), text
        assert "train_tracked.py" in text and "train_tracked.…" not in text, text
        # a longer label (the last column at 80) folds onto the next line, every letter kept
        assert "pkg.train_transformer" in "".join(text.split()) and "pkg.train_t…" not in text
        assert "finished" in text and "13,150" in text and "created" in text
    text = _list_text(monkeypatch, 120)
    assert "pkg.train_transformer" in text and "dur s" in text and "mlflow" in text


def test_store_list_total_is_honest_and_kind_filters(tmp_path, monkeypatch):
    """`runs list --store -n 1` does not call its one row the total, and --kind filters there
    as it does for this machine's records."""
    pytest.importorskip("mlflow")
    for i, kind in enumerate(("train", "train", "command")):
        w = RunWriter(tmp_path / "runs", kind=kind, run_id=f"20240301-00000{i}-abcdef")
        w.update(summary={"workload": "gpt2_tiny", "throughput_samples_per_s": 10.0 + i})
        w.finish()
    monkeypatch.setenv("GPULENS_HOME", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'store.db'}")
    assert _json(runner.invoke(runs_app, ["sync", "--json"]))["failed"] == []
    doc = _json(runner.invoke(runs_app, ["list", "--store", "-n", "1", "--json"]))
    assert len(doc["runs"]) == 1 and doc["total"] is None  # more in the store, count unknown
    doc = _json(runner.invoke(runs_app, ["list", "--store", "-n", "5", "--json"]))
    assert len(doc["runs"]) == 3 and doc["total"] == 3
    doc = _json(
        runner.invoke(runs_app, ["list", "--store", "--kind", "train", "-n", "1", "--json"])
    )
    assert [r["kind"] for r in doc["runs"]] == ["train"] and doc["total"] == 2
    doc = _json(runner.invoke(runs_app, ["list", "--store", "--kind", "command", "--json"]))
    assert [r["run_id"] for r in doc["runs"]] == ["20240301-000002-abcdef"]
    result = runner.invoke(runs_app, ["list", "--store", "--kind", "train", "-n", "1"])
    assert result.exit_code == 0 and "1 of 2" in result.stdout
    result = runner.invoke(runs_app, ["list", "--store", "-n", "1"])
    assert result.exit_code == 0 and "1 of 1" not in result.stdout and "more" in result.stdout


def test_store_list_keeps_run_id_and_status_whole_in_80_columns(tmp_path, monkeypatch):
    """`runs list --store` on an 80-column terminal cut the run id to "202…" and left status
    off the table (a long workload took the width); it fits its columns as `runs list` does."""
    import io

    from rich.console import Console

    import gpulens.cli.common as common

    pytest.importorskip("mlflow")
    run_id = "20240301-000001-abcdef"
    w = RunWriter(tmp_path / "runs", kind="command", name="python", run_id=run_id)
    long_cmd = "/work/main/.venv/bin/python examples/train_tracked.py --epochs 500 --no-track"
    w.update(summary={"workload": long_cmd, "throughput_samples_per_s": 10.0})
    w.finish()
    monkeypatch.setenv("GPULENS_HOME", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'store.db'}")
    assert _json(runner.invoke(runs_app, ["sync", "--json"]))["failed"] == []
    buf = io.StringIO()
    monkeypatch.setattr(common, "out", Console(file=buf, width=80))
    result = runner.invoke(runs_app, ["list", "--store"])
    assert result.exit_code == 0, result.output
    text = buf.getvalue()
    assert run_id in text and "finished" in text, text
    assert "train_tracked.py" in text, text  # the label whole, not `train_tracked.…`
    assert all(len(line) <= 80 for line in text.splitlines())


def test_store_list_of_an_unreachable_server_names_no_sync(monkeypatch):
    """`runs list --store` against a server that is down said "`gpulens runs sync` logs it
    later", though listing logs nothing; it names the tracking URI to check instead."""
    import socket

    pytest.importorskip("mlflow")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    result = runner.invoke(runs_app, ["list", "--store"])
    assert result.exit_code == 1
    message = str(result.exception)
    assert "unreachable" in message and "MLFLOW_TRACKING_URI" in message
    assert "runs sync" not in message


def test_list_filters_say_what_they_left_out(home):
    """`runs list --status bogus` printed "no runs in ...: start one with `gpulens run`" over
    a store of runs (exit 0); an unknown status is a usage error, and a filter that matches
    nothing says so."""
    result = runner.invoke(runs_app, ["list", "--status", "bogus"])
    assert isinstance(result.exception, UsageError)  # exit 2 through gpulens's main
    assert "choose one of running, finished" in str(result.exception)
    result = runner.invoke(runs_app, ["list", "--kind", "bogus"])
    assert result.exit_code == 0
    assert "start one" not in result.stdout and "has kind bogus" in result.stdout


def test_compare_keeps_field_names_on_one_line_in_80_columns(tmp_path, monkeypatch):
    """A long field name is one line (its middle cut where it cannot fit), not folded into
    two; the values wrap instead, and no run's column is cut off the table."""
    import io

    from rich.console import Console

    import gpulens.cli.common as common

    ids = [f"20261128-00000{i}-abcdef" for i in range(3)]
    for i, run_id in enumerate(ids):
        w = RunWriter(tmp_path / "runs", kind="train", name="tiny_cnn-cpu-b32", run_id=run_id)
        w.update(summary={"paired_fetch": {"read_s_per_sample_cached": 0.5 + i},
                          "throughput_samples_per_s": 100.0 + i})  # fmt: skip
        w.finish()
    monkeypatch.setenv("GPULENS_HOME", str(tmp_path))
    key = "paired_fetch.read_s_per_sample_cached"
    for runs in (ids[:2], ids):
        buf = io.StringIO()
        monkeypatch.setattr(common, "out", Console(file=buf, width=80))
        result = runner.invoke(runs_app, ["compare", *runs])
        assert result.exit_code == 0, result.output
        lines = buf.getvalue().splitlines()
        assert all(len(line) <= 80 for line in lines)
        row = next(line for line in lines if line.strip().startswith("paired_fetch"))
        values = [f"{0.5 + i:g}" for i in range(len(runs))]
        assert row.split()[: 1 + len(runs)] == [key, *values], row
        assert f"{99 + len(runs)}" in buf.getvalue()  # the last run's column is in sight
    from gpulens.cli.runs import _middle_cut

    assert _middle_cut(key, 16) == "paired_…e_cached" and _middle_cut(key, 40) == key


@pytest.mark.parametrize(
    ("command", "label"),
    [
        ("/usr/bin/python3 examples/train_plain.py -b 32", "train_plain.py"),
        (["python", "-u", "-W", "ignore", "train.py", "--epochs", "1"], "train.py"),
        ("python3.11 -m pkg.train --lr 0.1", "pkg.train"),
        ("python -mpkg.train", "pkg.train"),
        ("python -m torch.distributed.run --nproc-per-node 2 ddp.py", "ddp.py"),
        ("torchrun --nproc-per-node 2 /home/me/ddp.py", "ddp.py"),
        ("python -c 'import time'", "python -c"),
        ("/usr/bin/nvidia-smi -q", "nvidia-smi"),
        ("sh -c 'python x.py'", "sh"),
        ("python 'unbalanced", "'unbalanced"),
    ],
)
def test_a_commands_label_is_its_script_or_module_not_the_interpreter(command, label):
    from gpulens.record.labels import command_label

    assert command_label(command) == label


def test_list_and_report_label_a_command_by_its_script(tmp_path, monkeypatch):
    """`runs list` showed the interpreter's path (/usr/bin/python3) as a wrapped command's
    workload; it and the report now name its script, in records made before too. --json and
    the record keep the whole command."""
    import io

    from rich.console import Console

    import gpulens.cli.common as common
    from gpulens.record.reader import read_record
    from gpulens.report import document

    command = "/usr/bin/python3 examples/train_plain.py -b 32"
    run_id = "20261128-000001-aaaaaa"
    w = RunWriter(tmp_path / "runs", kind="command", name="python3", run_id=run_id)
    w.update(requested_config={"command": command, "sample_hz": 10.0},
             effective_config={"command": command, "pid": 1},
             summary={"wall_s": 1.0, "returncode": 0})  # fmt: skip
    w.finish()
    monkeypatch.setenv("GPULENS_HOME", str(tmp_path))
    buf = io.StringIO()
    monkeypatch.setattr(common, "out", Console(file=buf, width=120))
    assert runner.invoke(runs_app, ["list"]).exit_code == 0
    row = next(line for line in buf.getvalue().splitlines() if run_id in line)
    assert "train_plain.py" in row and "/usr/bin" not in row, row
    (listed,) = _json(runner.invoke(runs_app, ["list", "--json"]))["runs"]
    assert listed["workload"] == command  # the data keeps the whole command
    facts = dict(document.run_section(read_record(tmp_path / "runs" / run_id)).facts)
    assert facts["workload"] == "train_plain.py"
