"""`gpulens stalls -- CMD` on CPU: the tracker's ingestion-free and first-pass modes, the device
move, and the three runs of a user's script end to end."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from gpulens.cli import main
from gpulens.record.reader import list_records
from gpulens.record.tracker import read_tracker_summary
from gpulens.workloads.tracking import (
    FIRST_PASS_ENV,
    INGESTION_FREE_BATCHES,
    INGESTION_FREE_ENV,
    Tracker,
)


class CountingIterable:
    """``n`` batches, counting how many were asked for; no length."""

    def __init__(self, n: int):
        self.n = n
        self.fetched = 0

    def __iter__(self):
        for i in range(self.n):
            self.fetched += 1
            yield torch.full((4, 2), float(i))


class CountingLoader(CountingIterable):
    def __len__(self):
        return self.n


def test_ingestion_free_repeats_the_first_batches_and_ends_each_epoch(parent_run, monkeypatch):
    monkeypatch.setenv(INGESTION_FREE_ENV, "1")
    loader = CountingLoader(10)
    seen = []
    with Tracker(warmup_steps=1) as tracker:
        for _epoch in range(3):
            n = 0
            for batch in tracker.data(loader):
                seen.append(int(batch[0, 0]))
                n += 1
            assert n == len(loader)  # the epoch ends as without gpulens
    assert loader.fetched == INGESTION_FREE_BATCHES  # the loader was touched K times in all
    assert seen[:6] == [0, 1, 2, 3, 0, 1]
    assert set(seen) == set(range(INGESTION_FREE_BATCHES))
    summary = read_tracker_summary(parent_run)
    assert summary["steps_total"] == 30 and summary["measured_steps"] == 29
    assert summary["loader"]["ingestion_free"] is True
    assert summary["loader"]["cached_batches"] == INGESTION_FREE_BATCHES
    assert summary["loader"]["passes_completed"] == 3


def test_ingestion_free_without_len_repeats_until_the_script_stops(parent_run, monkeypatch):
    monkeypatch.setenv(INGESTION_FREE_ENV, "1")
    loader = CountingIterable(3)  # fewer batches than K
    with Tracker(warmup_steps=0) as tracker:
        for step, _batch in enumerate(tracker.data(loader)):
            if step == 19:
                break
    assert loader.fetched == 3
    assert read_tracker_summary(parent_run)["steps_total"] == 20


def test_first_pass_only_times_the_first_epoch(parent_run, monkeypatch):
    monkeypatch.setenv(FIRST_PASS_ENV, "1")
    loader = CountingLoader(8)
    with Tracker(warmup_steps=2) as tracker:
        for _epoch in range(3):
            for _batch in tracker.data(loader):
                tracker.step()
    assert loader.fetched == 24  # all epochs ran, reading the loader
    summary = read_tracker_summary(parent_run)
    assert summary["steps_total"] == 8 and summary["measured_steps"] == 6
    assert summary["loader"]["passes_completed"] == 3


def test_device_moves_nested_batches(parent_run):
    Pair = namedtuple("Pair", "x y")
    batch = (
        torch.ones(2, 3),
        {"a": torch.zeros(2), "b": [torch.ones(2), 7]},
        Pair(1, torch.ones(2)),
    )
    with Tracker(warmup_steps=0) as tracker:
        (got,) = list(tracker.data([batch], device="meta"))
    x, d, pair = got
    assert x.device.type == "meta" and d["a"].device.type == "meta"
    assert d["b"][0].device.type == "meta" and d["b"][1] == 7
    assert isinstance(pair, Pair) and pair.x == 1 and pair.y.device.type == "meta"
    summary = read_tracker_summary(parent_run)
    assert summary["loader"]["device"] == "meta"
    assert summary["phases_s"]["h2d"] is not None  # the move is timed as the copy phase


# Reads one file per sample and sleeps: a slow CPU prep the ingestion-free run does without.
SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    from torch.utils.data import DataLoader, Dataset
    import gpulens

    class Files(Dataset):
        def __init__(self, root):
            self.paths = sorted(p for p in Path(root).rglob("*.bin"))
        def __len__(self):
            return len(self.paths)
        def __getitem__(self, i):
            raw = self.paths[i].read_bytes()[:16]
            time.sleep(0.002)  # decode and augment
            return torch.tensor(list(raw), dtype=torch.float32)

    torch.set_num_threads(1)
    loader = DataLoader(Files(sys.argv[1]), batch_size=4, shuffle=True)
    model = torch.nn.Linear(16, 2)
    with gpulens.track(name="t") as tracker:
        for epoch in range(2):
            for x in tracker.data(loader, device="cpu"):
                model(x).sum().backward()
    """
)
# The same loop with no gpulens in it: its steps are injected (DataLoader and optimizer hooks).
UNMODIFIED = SCRIPT.replace("import gpulens\n", "").replace(
    """with gpulens.track(name="t") as tracker:
    for epoch in range(2):
        for x in tracker.data(loader, device="cpu"):
            model(x).sum().backward()
""",
    """opt = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(2):
    for x in loader:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
""",
)
assert "gpulens" not in UNMODIFIED


@pytest.fixture
def files_dir(tmp_path):
    root = tmp_path / "files"
    for c in range(2):
        (root / f"class_{c}").mkdir(parents=True)
        for i in range(40):
            (root / f"class_{c}" / f"f{i:03d}.bin").write_bytes(os.urandom(2048))
    return root


@pytest.mark.parametrize("script_kind", ["tracked", "unmodified"])
def test_stalls_of_a_command_json_contract(capfd, tmp_path, files_dir, gpulens_home, script_kind):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT if script_kind == "tracked" else UNMODIFIED)
    code = main(
        ["stalls", "--data", str(files_dir), "--no-store", "--json", "--",
         sys.executable, str(script), str(files_dir)]
    )  # fmt: skip
    captured = capfd.readouterr()
    assert code == 0, captured.err
    doc = json.loads(captured.out)  # the script's output stayed off stdout
    assert set(doc) >= {
        "workload", "device", "runs", "throughput_samples_per_s", "breakdown_pct",
        "single_run_estimate_pct", "what_if", "recommendations", "notes",
    }  # fmt: skip
    tput = doc["throughput_samples_per_s"]
    assert set(tput) == {"ingestion_free", "cached", "cold", "multi_gpu", "multi_gpu_socket"}
    assert doc["device"] == ("cpu" if script_kind == "tracked" else None)
    assert str(script) in doc["workload"]
    if script_kind == "unmodified":
        assert any("steps injected" in n for n in doc["notes"])
    # 2 ms of prep per sample, 8 ms per batch of 4: without it the loop is several times faster
    assert tput["ingestion_free"] > 2 * tput["cached"], doc
    shares = doc["breakdown_pct"]
    assert shares["prep_stall"] > 30
    assert shares["interconnect_stall"] is None and shares["network_stall"] is None
    assert any("interconnect" in n for n in doc["notes"])
    assert doc["single_run_estimate_pct"]["data_wait"] > 30
    assert doc["single_run_estimate_pct"]["from_run"] == doc["runs"]["cached"]
    assert "workers" in doc["what_if"]  # a DataLoader: its num_workers (0) is known
    # [low, high] beside each half-width: rates positive, shares within [0, 100]
    for kind, rate in tput.items():
        got = doc["throughput_ci95_samples_per_s"][kind]
        assert got is None if rate is None else 0 < got[0] <= rate <= got[1], (kind, got)
    for part, share in shares.items():
        got = doc["breakdown_ci95_range_pct"][part]
        assert got is None if share is None else 0 <= got[0] <= share <= got[1] <= 100
    assert doc["fetch_design"] == ("separate" if doc["fetch_method"] else None)
    records = {r.run_id: r for r in list_records(gpulens_home / "runs")}
    made = [doc["runs"][k] for k in ("ingestion_free", "cached", "cold") if doc["runs"][k]]
    assert all(records[r].meta["kind"] == "stalls" for r in made)
    for role in ("ingestion_free", "cached", "cold"):  # each run's part, in its run.json
        if doc["runs"][role]:
            assert records[doc["runs"][role]].result().role == f"stalls:{role}"
    assert all(records[r].status == "finished" for r in made)
    if doc["fetch_method"]:  # the files could be evicted: three runs, all components add up
        assert len(made) == 3 and tput["cold"]
        total = sum(shares[k] for k in ("compute", "prep_stall", "fetch_stall"))
        assert total == pytest.approx(100, abs=1.0)
        # the cold run timed only its first pass: 80 files, 4 per step, warm-up excluded
        cold = records[doc["runs"]["cold"]].meta["summary"]
        assert cold["steps_total"] == 20 and cold["loader"]["passes_completed"] == 2
    else:  # never a warm read reported as cold
        assert len(made) == 2 and tput["cold"] is None and shares["fetch_stall"] is None
        assert any("fetch stall not measured" in n for n in doc["notes"])


def test_stalls_of_a_command_without_the_tracker(capfd, tmp_path, files_dir, gpulens_home):
    script = tmp_path / "plain.py"
    script.write_text("print('training without gpulens')\n")
    code = main(
        ["stalls", "--data", str(files_dir), "--no-store", "--", sys.executable, str(script)]
    )
    err = capfd.readouterr().err
    assert code == 2
    assert "no steps were seen: the script must iterate a torch.utils.data.DataLoader" in err
    assert len(list_records(gpulens_home / "runs")) == 1  # stopped after the first run


def test_stalls_workload_and_command_options(capsys, files_dir):
    assert main(["stalls", "--data", str(files_dir), "--workers", "2", "--", "python", "x.py"]) == 2
    assert "--workers applies to built-in workloads only" in capsys.readouterr().err
    code = main(["stalls", "--data", str(files_dir), "--workers", "2", "--time-budget", "9",
                 "--", "python", "x.py"])  # fmt: skip
    assert code == 2
    assert "--workers, --time-budget apply to built-in workloads only" in capsys.readouterr().err
    assert main(["stalls", "tiny_cnn", "--data", str(files_dir), "--", "python", "x.py"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["stalls", "--data", str(files_dir)]) == 2
    assert "command after --" in capsys.readouterr().err
    assert main(["stalls", "--data", str(Path(files_dir) / "nope"), "--", "python", "x.py"]) == 2
    assert "does not exist" in capsys.readouterr().err
