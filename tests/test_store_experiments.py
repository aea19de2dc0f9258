"""Experiments in MLflow: a stalls result as a parent run over its runs (three real H100 runs
and their result), and a colocate experiment's trials as child runs of its run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gpulens.record.writer import RunWriter
from gpulens.store import mlflow_experiment, mlflow_sink

mlflow = pytest.importorskip("mlflow")
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")

FIXTURES = Path(__file__).parent / "fixtures"
RESULTS = Path(__file__).parents[1] / "benchmarks" / "results"
COLOCATE = RESULTS / "colocate-resnet50_resnet18-s8-8339c1c-NVIDIA_H100_80GB_HBM3-2026-11-24.json"


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def test_a_stalls_result_is_a_parent_over_its_runs(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    dirs = []
    for run in sorted((FIXTURES / "stalls_h100_resnet50_s8").iterdir()):
        dirs.append(tmp_path / "runs" / run.name)
        shutil.copytree(run, dirs[-1])
    result = json.loads((FIXTURES / "stalls_h100_resnet50_s8.result.json").read_text())
    children = [mlflow_sink.log_record(d, uri, "gpulens") for d in dirs]

    parent = mlflow_experiment.log_stalls_experiment(result, dirs, uri, "gpulens")
    run = client.get_run(parent)
    assert run.info.run_name == "stalls resnet50" and run.info.status == "FINISHED"
    assert run.data.metrics["breakdown_pct.prep_stall"] == pytest.approx(
        result["breakdown_pct"]["prep_stall"]
    )
    assert [a.path for a in client.list_artifacts(parent)] == ["stalls.json"]
    for child in children:
        assert client.get_run(child).data.tags["mlflow.parentRunId"] == parent
    nested = client.search_runs(
        [run.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'"
    )
    assert sorted(r.info.run_id for r in nested) == sorted(children)
    # again (a second `gpulens runs sync`, say): the same parent, no second one
    assert mlflow_experiment.log_stalls_experiment(result, dirs, uri, "gpulens") == parent
    assert len(client.search_runs([run.info.experiment_id])) == len(children) + 1


def test_colocate_trials_become_child_runs(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    doc = json.loads(COLOCATE.read_text())["result"]
    with RunWriter(tmp_path / "runs", kind="colocate", name="colocate-r50+r18",
                   role="colocate:experiment") as writer:  # fmt: skip
        writer.update(summary={"colocate": doc})
    parent = mlflow_sink.log_record(writer.dir, uri, "gpulens")

    children = mlflow_experiment.log_colocate_trials(writer.dir, uri, "gpulens")
    assert len(children) == len(doc["results"]) >= 3
    by_name = {client.get_run(c).info.run_name: client.get_run(c) for c in children}
    first = doc["results"][0]
    trial = by_name[f"{first['mechanism']} {first['setting']}"]
    assert trial.data.tags["mlflow.parentRunId"] == parent
    assert trial.data.params["mechanism"] == first["mechanism"]
    assert trial.data.metrics["jain_fairness"] == pytest.approx(first["jain_fairness"])
    job = first["jobs"][0]
    assert trial.data.metrics[f"{job['name']}.slowdown"] == pytest.approx(job["slowdown"])
    # each job's throughput named with what it counts, as a run's throughput_samples_per_s is
    together = f"{job['name']}.throughput_together_samples_per_s"
    assert trial.data.metrics[together] == pytest.approx(job["throughput_together"])
    assert f"{job['name']}.throughput_together" not in trial.data.metrics
    assert mlflow_experiment.log_colocate_trials(writer.dir, uri, "gpulens") == children


def test_a_logged_run_gets_its_report_page_as_an_artifact(tmp_path, monkeypatch):
    pytest.importorskip("plotly")
    from gpulens.cli.common import log_report_artifact

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run_dir = tmp_path / "runs" / "record"
    shutil.copytree(FIXTURES / "record_h100_resnet50_jpeg", run_dir)
    run_id = mlflow_sink.log_record(run_dir, uri)
    log_report_artifact(run_dir)
    client = mlflow.MlflowClient(uri)
    assert "report.html" in [a.path for a in client.list_artifacts(run_id)]
    page = Path(client.download_artifacts(run_id, "report.html", str(tmp_path))).read_text()
    assert "plotly" in page.lower() and "NVIDIA H100" in page


def test_colocate_trial_metrics_carry_each_job_s_unit_and_energy_per_what_it_counts():
    trial = {
        "mechanism": "time-slice", "jain_fairness": 0.9, "energy_vs_alone_ratio": 0.8,
        "energy_per_unit_j": None, "energy_per_sample_j": None, "energy_unit": None,
        "jobs": [{"name": "train", "throughput_alone": 100.0, "throughput_together": 60.0,
                  "throughput_unit": "samples/s", "slowdown": 1.67},
                 {"name": "infer", "throughput_alone": 20.0, "throughput_together": 20.0,
                  "throughput_unit": "requests/s", "slowdown": 1.0},
                 {"name": "sleep", "throughput_alone": 0.5, "throughput_together": 0.4,
                  "throughput_unit": "runs/s", "slowdown": 1.25}],
    }  # fmt: skip
    units = {j["name"]: j["throughput_unit"] for j in trial["jobs"]}
    metrics = mlflow_experiment.trial_metrics(trial, units)
    assert metrics["infer.throughput_alone_requests_per_s"] == 20.0
    assert metrics["sleep.throughput_together_runs_per_s"] == 0.4
    assert metrics["train.throughput_together_samples_per_s"] == 60.0
    assert metrics["energy_vs_alone_ratio"] == 0.8 and "energy_per_sample_j" not in metrics
    # jobs that count one thing: energy per that thing; a document from before the fix
    # (energy_per_sample_j summed over samples and runs) logs no energy per sample
    runs = {"energy_per_unit_j": 30.0, "energy_unit": "J/run", "jobs": []}
    assert mlflow_experiment.trial_metrics(runs, {"a": "runs/s"}) == {"energy_per_run_j": 30.0}
    old = {"energy_per_sample_j": 0.25, "jobs": []}
    assert mlflow_experiment.trial_metrics(old, {"a": "samples/s", "b": "runs/s"}) == {}
    assert mlflow_experiment.trial_metrics(old, {"a": "samples/s"}) == {"energy_per_sample_j": 0.25}
