"""An unmodified PyTorch script under `gpulens run --`: steps, samples and data wait with no
code change, the script's results unchanged, and nothing broken when injection cannot work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from signals import default_sigint

from gpulens.record.reader import read_record

SCRIPT = textwrap.dedent("""
    import os
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(1024, 16), torch.randint(0, 4, (1024,)))
    loader = DataLoader(data, batch_size=32, shuffle=True)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    it = iter(loader)
    # the iterator still looks like the DataLoader's own to code that inspects it
    print("iterator", len(it), hasattr(it, "_num_yielded"), flush=True)
    del it
    for epoch in range(2):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    print("final loss", repr(loss.item()), flush=True)
""")


def gpulens_run(tmp_path: Path, script: Path, *flags: str, env_extra=None, preexec=None):
    env = {"GPULENS_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin",
           **(env_extra or {})}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "gpulens.cli", "run", "--no-store", "--json", *flags, "--",
         sys.executable, str(script)],
        capture_output=True, text=True, timeout=240, env={**os.environ, **env},
        preexec_fn=preexec,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout), proc.stderr


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


@pytest.fixture(scope="module")
def unmodified_run(tmp_path_factory):
    """The script under `gpulens run --`, with a sitecustomize of the user's own on
    PYTHONPATH (gpulens injects through one of its own, which must still run theirs): one run
    read by the two tests below. The runs of the other tests here have none."""
    tmp_path = tmp_path_factory.mktemp("unmodified")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    marker = tmp_path / "marker"
    (theirs / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    path = os.pathsep.join(p for p in (str(theirs), os.environ.get("PYTHONPATH")) if p)
    doc, err = gpulens_run(tmp_path, script, env_extra={"PYTHONPATH": path})
    return script, doc, err, marker


@pytest.mark.slow
def test_an_unmodified_script_gets_steps_and_the_same_results(unmodified_run):
    script, doc, err, _ = unmodified_run
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=120, check=True).stdout  # fmt: skip
    assert "final loss" in err  # the script's output (kept off stdout under --json)
    loss = [line for line in err.splitlines() if line.startswith("final loss")][0]
    assert loss in plain  # injection never changes what the script computes
    assert "iterator 32 True" in err
    # 2 epochs x 32 batches = 64 steps, of 32 samples each; 5 warm-up steps
    assert doc["measured_steps"] == 64 - 5
    assert doc["throughput_samples_per_s"] > 0 and doc["phases_s"]["data_wait"] is not None
    steps = read_record(Path(doc["record_dir"])).series("steps")
    assert len(steps) == 64 and set(steps["samples"]) == {32}
    assert doc.get("tracking_error") is None


EVAL_LOOPS = {
    # pytorch/examples' imagenet and mnist scripts: the whole loop under no_grad
    "no_grad_loop": "    with torch.no_grad():\n"
                    "        for x, y in DataLoader(data, batch_size=64):\n"
                    "            model(x).sum()\n",
    # Hugging Face's evaluation loop: batches fetched with autograd on, forward under no_grad
    "no_grad_forward": "    for x, y in DataLoader(data, batch_size=64):\n"
                       "        with torch.no_grad():\n"
                       "            model(x).sum()\n",
    # Lightning's evaluation loop: a sized loader asked for exactly len() batches, never for
    # the one more that would end it (its last batch is closed by the next fetch elsewhere)
    "sized_no_stop": "    with torch.no_grad():\n"
                     "        val = DataLoader(data, batch_size=64)\n"
                     "        it = iter(val)\n"
                     "        for _ in range(len(val)):\n"
                     "            model(next(it)[0]).sum()\n",
}  # fmt: skip
EVAL_ORDER = ("no_grad_loop", "no_grad_forward", "sized_no_stop")
assert set(EVAL_ORDER) == set(EVAL_LOOPS)


@pytest.mark.slow
def test_evaluation_batches_are_no_training_steps(tmp_path):
    """An evaluation pass after each epoch (no optimizer step): its batches are not steps. One
    run holds the three kinds of evaluation loop one after the other, the sized loader's last,
    so that the next fetch to close its last batch is the training loop's, as on its own; a
    batch of any of them counted as a step shows in the step count and in the batch sizes."""
    path = tmp_path / "with_eval.py"
    # after each epoch's training loop, inside the epoch loop
    with_eval = SCRIPT.replace(
        "        opt.step()\n",
        "        opt.step()\n" + "".join(EVAL_LOOPS[name] for name in EVAL_ORDER),
    )
    assert with_eval != SCRIPT
    path.write_text(with_eval)
    doc, err = gpulens_run(tmp_path, path)
    assert doc["measured_steps"] == 64 - 5, err[-1500:]
    steps = read_record(Path(doc["record_dir"])).series("steps")
    assert set(steps["samples"]) == {32}  # no evaluation batch (64) among them


@pytest.mark.slow
def test_no_inject_leaves_the_script_alone(tmp_path, script):
    doc, _ = gpulens_run(tmp_path, script, "--no-inject")
    assert doc["measured_steps"] is None
    assert not (Path(doc["record_dir"]) / "series" / "steps.parquet").exists()


@pytest.mark.slow
def test_a_script_that_tracks_itself_is_not_counted_twice(tmp_path):
    path = tmp_path / "tracked.py"
    path.write_text(SCRIPT.replace(
        "for epoch in range(2):\n    for x, y in loader:",
        "import gpulens\ntracker = gpulens.track()\nfor epoch in range(2):\n"
        "    for x, y in tracker.data(loader):",
    ))  # fmt: skip
    doc, _ = gpulens_run(tmp_path, path)
    assert doc["measured_steps"] == 64 - 5


@pytest.mark.slow
def test_the_childs_own_sitecustomize_still_runs(unmodified_run):
    _, doc, _, marker = unmodified_run
    assert marker.read_text() == "ran" and doc["measured_steps"] == 64 - 5


def test_a_failure_in_the_hook_hands_back_the_real_iterator(monkeypatch, capsys):
    from gpulens.workloads import inject

    class Loader:
        def __iter__(self):
            return iter([1, 2, 3])

    module = type("M", (), {"DataLoader": Loader})
    monkeypatch.setitem(inject._state, "failed", None)
    monkeypatch.setattr(inject, "_tracker", lambda: (_ for _ in ()).throw(OSError("disk full")))
    inject._patch_dataloader(module)
    assert list(Loader()) == [1, 2, 3]
    assert "could not be injected" in capsys.readouterr().err


def test_ingestion_free_replay_makes_one_loader_iterator_not_one_per_epoch(tmp_path, monkeypatch):
    """Under `gpulens stalls`, the replayed batches are taken once: no worker processes are
    started (nor batches prefetched) again each epoch while the run measures compute."""
    from gpulens.workloads import inject
    from gpulens.workloads.tracking import INGESTION_FREE_ENV, Tracker

    class Loader:
        made = 0

        def __iter__(self):
            Loader.made += 1
            return iter(range(10))

        def __len__(self):
            return 10

    run_dir = tmp_path / "run"
    (run_dir / "series").mkdir(parents=True)
    monkeypatch.setenv("GPULENS_RUN_DIR", str(run_dir))
    monkeypatch.setenv(INGESTION_FREE_ENV, "1")
    tracker = Tracker(warmup_steps=0, injected=True)
    monkeypatch.setitem(inject._state, "failed", None)
    monkeypatch.setattr(inject, "_tracker", lambda: tracker)
    inject._patch_dataloader(type("M", (), {"DataLoader": Loader}))
    loader = Loader()
    epochs = [list(loader) for _ in range(3)]
    tracker.close()
    assert Loader.made == 1
    assert epochs == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1]] * 3  # the first 4 batches, len() per epoch


def _sigint_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_duration_stops_an_endless_script_and_keeps_its_steps(tmp_path, sigint):
    """Stopped by SIGTERM, which the injected script turns into a clean exit: its steps are
    kept and no KeyboardInterrupt traceback of wherever the stop found it is printed (as a
    SIGINT first had); also in a job started in the background (SIGINT ignored)."""
    path = tmp_path / "endless.py"
    path.write_text(SCRIPT.replace("for epoch in range(2):", "while True:"))
    preexec = default_sigint if sigint == "default" else _sigint_ignored
    doc, err = gpulens_run(tmp_path, path, "--duration", "8", preexec=preexec)
    assert doc["status"] == "finished" and doc.get("stop_reason") == "duration", err[-1500:]
    assert doc["measured_steps"] > 10 and doc["throughput_samples_per_s"] > 0
    assert "KeyboardInterrupt" not in err, err[-1500:]


@pytest.mark.slow
def test_steps_ends_an_endless_script_after_that_many_measured_steps(tmp_path):
    path = tmp_path / "endless.py"
    path.write_text(SCRIPT.replace("for epoch in range(2):", "while True:"))
    doc, err = gpulens_run(tmp_path, path, "--steps", "25")
    assert doc["status"] == "finished" and doc.get("stop_reason") == "steps", err[-1500:]
    assert doc["measured_steps"] == 25 and doc["throughput_samples_per_s"] > 0


def test_steps_with_a_command_needs_injection(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "gpulens.cli", "run", "--no-store", "--no-inject", "--steps", "5",
         "--", sys.executable, "-c", "pass"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "GPULENS_HOME": str(tmp_path / "home")},
    )  # fmt: skip
    assert proc.returncode == 2 and "drop --no-inject" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "home" / "runs").exists() or not any(
        (tmp_path / "home" / "runs").iterdir()
    )
