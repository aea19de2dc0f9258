"""`gpulens allocate-workers`: curves from the store's runs (measured or predicted), the
allocation (greedy marginal gain, exact DP) against an even split, and the CLI."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from gpulens.cli import main
from gpulens.errors import UsageError
from gpulens.predict.workers import (
    Curve,
    _values,
    allocate,
    curve_for_job,
    dynamic_programme,
    even_split,
    greedy,
    predicted_curve,
)

FIXTURES = Path(__file__).parent / "fixtures"
LOADER_RUN = FIXTURES / "stalls_h100_resnet50_s8" / "20261124-082105-01408d"  # 8 workers
OLD_RECORD = FIXTURES / "record_h100_resnet50_jpeg"  # 15 workers, in effective_config only


def saturating(job: str, per_worker: float, ceiling: float, cpus: int) -> Curve:
    """A concave curve: linear in the workers until the GPU's ceiling."""
    ws = tuple(range(1, cpus + 1))
    return Curve(job, ws, tuple(min(per_worker * w, ceiling) for w in ws), "measured")


def brute_force(curves: list[Curve], cpus: int, objective: str) -> float:
    values = _values(curves, cpus, objective)
    best = -np.inf
    for alloc in itertools.product(range(1, cpus + 1), repeat=len(curves)):
        if sum(alloc) <= cpus:
            best = max(best, sum(values[j, w] for j, w in enumerate(alloc)))
    return best


# ------------------------------------------------------------------------------ curves
def test_curve_interpolates_and_extrapolates_conservatively():
    c = Curve("a", (2, 4, 8), (100.0, 180.0, 200.0), "measured")
    assert c.at(1) == pytest.approx(50.0)  # below the first point: proportional
    assert c.at(3) == pytest.approx(140.0)
    assert c.at(16) == pytest.approx(200.0)  # beyond the last: flat


@pytest.mark.parametrize(
    "ws,ts", [((2, 1), (1.0, 2.0)), ((1, 1), (1.0, 1.0)), ((1,), (1.0, 2.0)), ((1,), (-1.0,))]
)
def test_bad_curves(ws, ts):
    with pytest.raises(UsageError):
        Curve("a", ws, ts, "measured")


def test_predicted_curve_from_a_loader_bound_run():
    # 8 workers, step 0.1 s of which 0.06 s waiting, batch 128: the GPU alone needs 0.04 s.
    from gpulens.predict.workers import worker_decline_ratio

    c = predicted_curve("a", 128, 0.1, 0.06, 8, 32)
    assert c.at(8) == pytest.approx(1280.0)  # what the run measured
    # loader-bound below: half the workers, each a little faster with fewer beside it (the
    # decline `predict --workers` uses)
    assert c.at(4) == pytest.approx(640.0 * worker_decline_ratio(8, 4))
    assert 640.0 < c.at(4) < 700.0
    assert c.at(32) == pytest.approx(128 / 0.04)  # the GPU's ceiling
    assert c.source == "predicted" and "loader-bound" in c.note
    # on a host of 8 CPUs, 16 workers and the training process share them: the loader gains
    # less than twice from 8 workers to 16
    small = predicted_curve("a", 128, 0.1, 0.06, 8, 16, host_cpus=8)
    assert small.at(16) == pytest.approx(2560.0 * worker_decline_ratio(8, 16, 8))
    assert small.at(16) < 1.5 * small.at(8)


def test_measured_curve_from_runs_at_several_worker_counts():
    def meta(workers: int, tput: float, status: str = "finished", data: str = "/img") -> dict:
        return {
            "status": status,
            "effective_config": {"workload": "r", "data": data},
            "summary": {
                "workload": "r",
                "workers": workers,
                "batch_size": 64,
                "measured_steps": 10,
                "throughput_samples_per_s": tput,
                "gpu": {"name": "H100"},
            },  # fmt: skip
        }

    metas = [meta(2, 100), meta(2, 110), meta(2, 90), meta(8, 300), meta(4, 999, "failed"),
             meta(4, 5000, data="synthetic")]  # fmt: skip
    c = curve_for_job("r", metas, 16)
    assert c.source == "measured" and c.workers == (2, 8)
    assert c.throughput_samples_per_s == (100.0, 300.0)  # the median of three
    one = curve_for_job("r", [meta(2, 100) | {"summary": {**meta(2, 100)["summary"],
                              "phases_s": {"step": 0.64, "data_wait": 0.3}}}], 16)  # fmt: skip
    assert one.source == "predicted"
    with pytest.raises(UsageError, match="gpulens run q --data DIR --workers N"):
        curve_for_job("q", metas, 16)


# ------------------------------------------------------------------------------ allocation
@pytest.mark.parametrize("objective", ["normalized", "samples"])
def test_greedy_beats_an_even_split_on_unlike_concave_curves(objective):
    cpus = 12
    curves = [
        saturating("hungry", 100.0, 1000.0, cpus),  # needs 10 workers to saturate
        saturating("light", 400.0, 800.0, cpus),  # saturated at 2
        saturating("middle", 150.0, 600.0, cpus),  # saturated at 4
    ]
    alloc = allocate(curves, cpus, objective, method="greedy")
    assert sum(alloc.workers) == cpus and alloc.even_workers == (4, 4, 4)
    assert alloc.value > alloc.even_value * 1.05 and alloc.gain_pct > 5
    assert alloc.workers[0] > alloc.workers[1]  # the hungry job gets more
    dp = allocate(curves, cpus, objective, method="dp")
    assert dp.value == pytest.approx(alloc.value)  # greedy is optimal on concave curves
    assert dp.value == pytest.approx(brute_force(curves, cpus, objective))


@pytest.mark.parametrize("method", ["greedy", "dp"])
def test_identical_curves_get_an_even_split(method):
    ws = tuple(range(1, 10))
    concave = [Curve(f"j{i}", ws, tuple(100 * w**0.5 for w in ws), "measured") for i in range(3)]
    alloc = allocate(concave, 9, method=method)
    assert alloc.workers == (3, 3, 3) and alloc.gain_pct == pytest.approx(0.0)
    # Piecewise linear: other splits tie with the even one, which is kept.
    flat_top = [saturating(f"j{i}", 100.0, 500.0, 9) for i in range(3)]
    alloc = allocate(flat_top, 9, method=method)
    assert alloc.workers == (3, 3, 3) and alloc.value == pytest.approx(alloc.even_value)


def test_dp_is_exact_where_greedy_is_not():
    # A convex step: nothing until 4 workers. Greedy sees no marginal gain and never starts.
    step = Curve("step", (1, 3, 4, 6), (0.0, 0.0, 1000.0, 1000.0), "measured")
    smooth = saturating("smooth", 30.0, 180.0, 6)
    values = _values([step, smooth], 6, "samples")
    dp, gr = dynamic_programme(values, 6), greedy(values, 6)
    assert dp == (4, 2)
    total = lambda a: sum(values[j, w] for j, w in enumerate(a))  # noqa: E731
    assert total(dp) > total(gr)
    assert total(dp) == pytest.approx(brute_force([step, smooth], 6, "samples"))


def test_even_split_spreads_the_remainder():
    assert even_split(3, 10) == (4, 3, 3) and sum(even_split(4, 17)) == 17


def test_allocation_rejects_bad_input():
    c = [saturating("a", 1.0, 2.0, 4)] * 3
    with pytest.raises(UsageError, match="--cpus must be at least the number of jobs"):
        allocate(c, 2)
    with pytest.raises(UsageError, match="--objective"):
        allocate(c, 4, "fairness")


# ------------------------------------------------------------------------------ CLI
def _store_run(home: Path, name: str, workers: int, tput: float) -> None:
    dest = home / "runs" / name
    shutil.copytree(LOADER_RUN, dest)
    meta = json.loads((dest / "run.json").read_text())
    meta["run_id"] = name
    meta["summary"].update(workers=workers, throughput_samples_per_s=tput)
    (dest / "run.json").write_text(json.dumps(meta))


def test_cli_allocates_from_measured_and_predicted_curves(capsys, gpulens_home):
    for i, (w, t) in enumerate([(2, 400.0), (4, 800.0), (8, 1300.0), (16, 1350.0)]):
        _store_run(gpulens_home, f"r{i}", w, t)
    code = main(["allocate-workers", "resnet50", "resnet50", "--cpus", "12", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)
    assert [j["workers"] for j in doc["jobs"]] == [6, 6]  # the same curve twice: even
    assert doc["jobs"][0]["curve"] == "measured" and "4 runs" in doc["jobs"][0]["curve_note"]
    assert doc["aggregate"]["gain_pct"] == pytest.approx(0.0)
    code = main(["allocate-workers", "resnet50", "--cpus", "8"])
    out, err = capsys.readouterr()
    assert code == 0 and "even split" in out


def test_an_older_record_keeps_its_workers_in_the_config(capsys, gpulens_home):
    old = json.loads((OLD_RECORD / "run.json").read_text())
    assert "workers" not in old["summary"] and old["effective_config"]["workers"] == 15
    assert "GPU-bound at 15 workers" in curve_for_job("resnet50", [old], 16).note
    # two such runs at 4 and 15 workers: a measured curve, not both read as in-process
    four = {**old, "effective_config": {**old["effective_config"], "workers": 4}}
    assert curve_for_job("resnet50", [four, old], 16).workers == (4, 15)
    shutil.copytree(OLD_RECORD, gpulens_home / "runs" / OLD_RECORD.name)
    code = main(["allocate-workers", "resnet50", "--cpus", "16", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "GPU-bound at 15 workers" in json.loads(out)["jobs"][0]["curve_note"]


def test_a_run_named_as_a_job_is_the_run_its_curve_is_built_from(capsys, gpulens_home):
    # the store holds no run of resnet50: the named run is used, not dropped for its workload
    code = main(["allocate-workers", str(OLD_RECORD), str(LOADER_RUN), "--cpus", "16", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    notes = [j["curve_note"] for j in json.loads(out)["jobs"]]
    assert "at 15 workers" in notes[0] and "at 8 workers" in notes[1]
    # with store runs of its workload, batch size and GPU at other counts: measured, with it
    for i, (w, t) in enumerate([(2, 400.0), (4, 800.0)]):
        _store_run(gpulens_home, f"r{i}", w, t)
    code = main(["allocate-workers", str(LOADER_RUN), "--cpus", "16", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "3 runs at workers [2, 4, 8]" in json.loads(out)["jobs"][0]["curve_note"]


def test_a_named_run_and_a_workload_of_its_model_get_distinct_labels(capsys, gpulens_home):
    """A job given as a run is labelled by its run id beside its workload, so that it is not
    taken for a job of the workload given by name."""
    shutil.copytree(OLD_RECORD, gpulens_home / "runs" / OLD_RECORD.name)
    run_id = json.loads((LOADER_RUN / "run.json").read_text())["run_id"]
    args = ["allocate-workers", str(LOADER_RUN), "resnet50", "--cpus", "16"]
    code = main([*args, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert [j["job"] for j in json.loads(out)["jobs"]] == [f"resnet50 ({run_id})", "resnet50"]
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"({run_id})" in out and f"resnet50 ({run_id}): measured curve" in out


def test_a_named_run_without_a_data_loader_exits_2_naming_it(capsys, gpulens_home):
    synthetic = FIXTURES / "record_h100_resnet50_synthetic"
    code = main(["allocate-workers", str(synthetic), "--cpus", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "run 20261123-122221-e3c380 is no finished run of resnet50" in err
    assert len(err.strip().splitlines()) == 1


def test_a_named_command_run_exits_2_saying_it_is_a_command(capsys, gpulens_home, tmp_path):
    """A `gpulens run -- python train.py` run has no workload: the message said "run X is no
    finished run of X ... `gpulens run X --data DIR`", the run id as a workload."""
    run = tmp_path / "command"
    shutil.copytree(LOADER_RUN, run)
    meta = json.loads((run / "run.json").read_text())
    meta["kind"] = "command"
    meta["summary"] = {**meta["summary"], "workload": None}
    meta["effective_config"] = {**meta["effective_config"], "workload": None}
    (run / "run.json").write_text(json.dumps(meta))
    code = main(["allocate-workers", str(run), "resnet50", "--cpus", "8"])
    err = capsys.readouterr().err
    assert code == 2 and "is a command (`gpulens run -- ...`)" in err, err
    assert f"gpulens run {meta['run_id']}" not in err and len(err.strip().splitlines()) == 1


def test_cli_without_runs_exits_2_with_one_line(capsys):
    code = main(["allocate-workers", "resnet50", "--cpus", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "gpulens run resnet50 --data DIR" in err
    assert len(err.strip().splitlines()) == 1
    code = main(["allocate-workers", "tiny_cnn", "resnt50", "--cpus", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown workload 'resnt50'; choose one of: " in err
    assert "resnet50" in err and "gpulens run resnt50" not in err
    assert len(err.strip().splitlines()) == 1
    code = main(["allocate-workers", "a", "b", "c", "--cpus", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--cpus must be at least" in err


def test_a_bad_objective_is_named_before_the_store_is_read(capsys):
    """An empty store (or an unknown job) answered `--objective foo` with "run it first": the
    user fixed that and only then heard the objective was wrong."""
    code = main(["allocate-workers", "resnet50", "--cpus", "4", "--objective", "foo"])
    err = capsys.readouterr().err
    assert code == 2 and "--objective must be one of normalized, samples, got 'foo'" in err, err
    assert len(err.strip().splitlines()) == 1


def test_more_cpus_than_a_host_has_is_an_error_not_minutes_of_waiting(capsys):
    """--cpus 1000000 ran the exact split's programme (square in the CPUs) for minutes."""
    code = main(["allocate-workers", "resnet50", "--cpus", "1000000"])
    err = capsys.readouterr().err
    assert code == 2 and "--cpus must be at most 1024 (one host's CPUs), got 1000000" in err, err
    assert len(err.strip().splitlines()) == 1
