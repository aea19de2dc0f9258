"""`gpulens report`: figures built from records made on a real H100, and the HTML file."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("plotly", reason="the report needs the [ui] extra (in [dev])")

from gpulens.cli import main  # noqa: E402
from gpulens.record.reader import RunRecord, read_record  # noqa: E402
from gpulens.report import document, figures  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
JPEG = FIXTURES / "record_h100_resnet50_jpeg"
SYNTHETIC = FIXTURES / "record_h100_resnet50_synthetic"
# The three runs of `gpulens stalls resnet50 --data JPEGs --precision bf16` on an H100
# (benchmarks/refactor_check.sh, 2026-11-24), prep series left out.
STALLS = FIXTURES / "stalls_h100_resnet50_s8"
RESULTS = Path(__file__).parents[1] / "benchmarks" / "results"
COLOCATE = RESULTS / "colocate-resnet50_resnet18-s8-8339c1c-NVIDIA_H100_80GB_HBM3-2026-11-24.json"


def _traces(fig, kind=None):
    return [t for t in fig.data if kind is None or t.type == kind]


def test_timeline_draws_every_gpu_sample_and_every_measured_step():
    record = read_record(JPEG)
    gpu, steps = record.series("gpu"), record.series("steps")
    fig = figures.timeline_figure(gpu, steps, "t")
    names = {t.name for t in fig.data}
    assert {"SM activity", "tensor-core activity", "DRAM bandwidth", "memory used", "power",
            "SM clock", "data wait", "h2d", "compute"} <= names  # fmt: skip
    util = next(t for t in fig.data if t.name.startswith("GPU utilization"))
    assert len(util.x) == len(gpu) and list(util.y) == list(gpu["gpu_util_pct"])
    bars = _traces(fig, "bar")
    measured = steps[~steps["warmup"]]
    assert all(len(b.x) == len(measured) for b in bars)
    # The phases stack to each step's time (a loader-bound run: mostly data wait).
    total_ms = sum(sum(b.y) for b in bars)
    assert total_ms == pytest.approx(
        1000 * measured[["data_wait_s", "h2d_s", "compute_s"]].sum().sum()
    )
    assert min(util.x) >= 0  # time from the run's first sample or step


def test_a_run_with_warm_up_steps_alone_draws_its_gpu_rows_without_a_step_row():
    """`gpulens run --duration 10 -- python script.py` stopped before its first measured step:
    its report crashed on the empty bars (plotly refused an empty width Series)."""
    record = read_record(JPEG)
    gpu, steps = record.series("gpu"), record.series("steps")
    warm = steps.head(3).assign(warmup=True)
    fig = figures.timeline_figure(gpu, warm, "t")
    assert fig is not None and not _traces(fig, "bar")
    assert figures.timeline_figure(None, warm, "t") is None


def test_the_report_line_counts_one_run_in_the_singular(tmp_path, capsys):
    assert main(["report", str(JPEG), "-o", str(tmp_path / "r.html")]) == 0
    assert " 1 run, " in capsys.readouterr().out.replace("\n", "")


def test_an_hour_of_steps_is_averaged_into_bins_with_the_same_mean():
    import pandas as pd

    n = 36_000
    steps = pd.DataFrame({
        "time_unix_s": [0.1 * i for i in range(n)], "warmup": [False] * n,
        "data_wait_s": [0.01 * (i % 7) for i in range(n)], "h2d_s": [0.001] * n,
        "compute_s": [0.05] * n, "step_time_s": [0.1] * n,
    })  # fmt: skip
    phases = figures.step_phases(steps, 0.0)
    assert len(phases) == figures.MAX_STEP_BARS
    assert phases["data_wait_ms"].mean() == pytest.approx(1000 * steps["data_wait_s"].mean())
    # The bins tile the run: their widths add up to its measured time.
    assert phases["width_s"].sum() == pytest.approx(steps["step_time_s"].sum())


def test_stall_figure_shows_the_stored_breakdown_with_its_intervals():
    section = document.stall_section([read_record(p) for p in sorted(STALLS.iterdir())])
    (fig,) = section.figures
    stored = json.loads(next(RESULTS.glob("stalls-*-s8-8339c1c-*.json")).read_text())["result"]
    bars = {t.name: t for t in fig.data}
    assert set(bars) == {"compute", "prep stall", "fetch stall"}
    for part in ("compute", "prep_stall", "fetch_stall"):
        bar = bars[part.replace("_", " ")]
        assert bar.x[0] == pytest.approx(stored["breakdown_pct"][part])
        assert bar.error_x.array[0] == pytest.approx(stored["breakdown_ci95_pp"][part])
    assert sum(b.x[0] for b in fig.data) == pytest.approx(100)


def test_stall_runs_carry_the_what_if_curves_of_their_result(tmp_path):
    """`gpulens stalls` keeps its what-if predictions in its runs; the report draws them."""
    from gpulens.record.writer import amend_summary

    stored = json.loads(next(RESULTS.glob("stalls-*-s8-8339c1c-*.json")).read_text())["result"]
    dirs = []
    for run in sorted(STALLS.iterdir()):
        dirs.append(tmp_path / run.name)
        shutil.copytree(run, dirs[-1])
        amend_summary(dirs[-1], stalls_what_if=stored["what_if"])
    section = document.stall_section([read_record(d) for d in dirs])
    _bars, curves = section.figures
    workers, cache = curves.data
    assert list(workers.x) == sorted(float(w) for w in stored["what_if"]["workers"])
    assert workers.y[-1] == pytest.approx(stored["what_if"]["workers"]["16"])
    assert cache.y[0] == pytest.approx(stored["what_if"]["page_cache_pct"]["0"])


def test_colocate_figures_give_each_job_and_mechanism_its_slowdown():
    doc = json.loads(COLOCATE.read_text())["result"]
    bars, heat_fig, combined = figures.colocate_figures(doc)
    (heat,) = heat_fig.data
    labels = list(heat.x)
    assert labels[:2] == ["time-slice", "streams"] and len(labels) == len(doc["results"])
    for row, job in zip(heat.z, heat.y, strict=True):
        for label, value in zip(labels, row, strict=True):
            result = doc["results"][labels.index(label)]
            stored = next(j for j in result["jobs"] if j["name"] == job)
            assert value == pytest.approx(stored["slowdown"])
    fairness = next(t for t in combined.data if t.name == "Jain fairness")
    assert list(fairness.y) == [r["jain_fairness"] for r in doc["results"]]
    assert bars.layout.yaxis.title.text == "samples/s"  # two training jobs: one unit


def test_colocate_figures_name_each_job_s_throughput_unit():
    """Training (samples/s), an inference tenant (requests/s) and a command (runs/s) on one
    chart: the unit is each trace's, and the axis does not claim one for all."""
    doc = json.loads(COLOCATE.read_text())["result"]
    train, other = doc["jobs"][:2]
    other.update(kind="cmd", batch_size=None)  # a record from before the unit field
    for r in doc["results"]:
        r["jobs"] = [j for j in r["jobs"] if j["name"] in (train["name"], other["name"])]
    doc["jobs"] = [train, other]
    bars = figures.colocate_figures(doc)[0]
    names = {t.name for t in bars.data}
    assert f"{train['name']} together (samples/s)" in names
    assert f"{other['name']} together (runs/s)" in names
    assert f"{other['name']} alone (runs/s)" in names
    assert "samples/s" not in bars.layout.yaxis.title.text


def test_comparison_marks_differences_beyond_the_intervals():
    a, b = read_record(JPEG), read_record(SYNTHETIC)
    section = document.comparison_section([a, b])
    header, tput, *_ = section.table
    ta, tb = (r.meta["summary"]["throughput_samples_per_s"] for r in (a, b))
    assert tput[1].startswith(f"{ta:,.2f}") and f"({100 * (tb / ta - 1):+.1f}%)" in tput[2]
    assert (1, 2) in section.marked  # JPEGs from disk vs synthetic data: far apart
    same = document.comparison_section([a, a])
    assert not same.marked


def test_report_command_writes_one_offline_html_file(tmp_path, capsys):
    out = tmp_path / "r.html"
    runs = [str(JPEG), str(SYNTHETIC), str(STALLS)]
    assert main(["report", *runs, "-o", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    page = out.read_text()
    assert doc["figures"] == len(re.findall(r"id=\"figure-\d+\"", page)) >= 6
    assert len(doc["runs"]) == 5
    # plotly.js inlined, nothing fetched: no script or stylesheet from the network.
    assert "Plotly" in page and not re.search(r"<(script|link)[^>]+(src|href)=.https?:", page)
    assert "stall breakdown" in page and "comparison" in page
    assert oct(out.stat().st_mode & 0o777) != oct(0o600)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["report", "no-such-run"], "no runs stored"),
        (["report", str(JPEG), "-o", "/nonexistent/dir/r.html"], "does not exist"),
    ],
)
def test_report_usage_errors_are_one_line(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("GPULENS_HOME", str(tmp_path))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_report_without_plotly_names_the_extra(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "plotly", None)
    assert main(["report", str(JPEG), "-o", str(tmp_path / "r.html")]) == 2
    assert "pip install 'gpulens[ui]'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_record_without_series_gets_a_note_not_a_figure(tmp_path):
    record = RunRecord(tmp_path, {"run_id": "x", "status": "failed", "kind": "train",
                                  "error": "boom", "summary": {}})  # fmt: skip
    section = document.run_section(record)
    assert not section.figures and "no GPU or step series" in section.notes[0]
    assert ("error", "boom") in section.facts


def test_stall_runs_of_an_incomplete_experiment_get_a_note():
    paired = [read_record(p) for p in sorted(STALLS.iterdir())][-1:]
    section = document.stall_section(paired)
    assert not section.figures and "no ingestion_free or cached run" in section.notes[0]


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt install chromium)")
def test_the_report_renders_in_a_headless_browser_without_errors(tmp_path):
    """Every figure of a report on real H100 runs is drawn by plotly in Chromium, offline, and
    the page logs no JavaScript error."""
    out = tmp_path / "r.html"
    assert main(["report", str(JPEG), str(STALLS), "-o", str(out)]) == 0
    figures_in_page = len(re.findall(r"id=\"figure-\d+\"", out.read_text()))
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
         "--v=0", "--virtual-time-budget=10000", "--dump-dom", out.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    dom, log = proc.stdout, proc.stderr
    console = [line for line in log.splitlines() if ":CONSOLE" in line]
    assert not [line for line in console if "Uncaught" in line or "Error" in line], console
    # plotly replaced each figure's div with a drawn plot (an SVG root per figure at least).
    drawn = len(re.findall(r'class="plot-container plotly"', dom))
    assert drawn == figures_in_page >= 6
    assert dom.count('class="trace bars') >= 6  # the step phases and the stall segments


def test_long_lines_keep_their_peaks_and_histograms_count_every_step():
    import pandas as pd

    y = pd.Series([50.0] * 100_000)
    y[54_321], y[77_777] = 100.0, 0.0  # one sample at full use, one idle
    x = pd.Series(range(100_000), dtype=float)
    xs, ys = figures.min_max_points(x, y)
    assert len(ys) <= figures.MAX_LINE_POINTS
    assert 54_321 in set(xs) and 77_777 in set(xs) and list(xs) == sorted(xs)
    steps_ms = pd.Series([10.0] * 360_000 + [500.0] * 10)
    fig = figures.step_time_figure({"hour": steps_ms})
    assert sum(fig.data[0].y) == len(steps_ms)  # counted on the server; the tail in the last bin
    assert len(fig.data[0].x) == figures.HISTOGRAM_BINS


def test_a_closed_loop_load_run_reports_without_an_intended_rate():
    """`load --concurrency` intends no rate (null): its facts line shows the achieved one."""
    from gpulens.report.serving import load_facts

    summary = {"url": "http://x", "tenants": {"m": {"achieved_rate_rps": 41.5,
               "intended_rate_rps": None, "latency_ms": {"p50": 2.0}, "slo_ms": None}}}  # fmt: skip
    facts = dict(load_facts(summary))
    assert facts["m"].startswith("41.5 req/s")
    summary["tenants"]["m"]["intended_rate_rps"] = 50.0
    assert dict(load_facts(summary))["m"].startswith("41.5 of 50.0 req/s")


def test_a_searched_load_run_draws_each_trial_apart():
    """A --find-max or --sweep run's requests hold every trial, each at its own rate and with
    its clock from 0: pooled into one curve per tenant they read as one rate's latencies."""
    import numpy as np
    import pandas as pd

    from gpulens.report.serving import latency_cdf_figure, latency_over_time_figure

    def trial(k: int, latency_ms: float) -> pd.DataFrame:
        return pd.DataFrame({"trial": k, "model": "m", "scheduled_s": np.arange(50) / 50.0,
                             "latency_ms": latency_ms, "status": 200,
                             "measured": True})  # fmt: skip

    requests = pd.concat([trial(0, 2.0), trial(1, 40.0)], ignore_index=True)
    for fig in (latency_over_time_figure(requests), latency_cdf_figure(requests)):
        assert [t.name for t in fig.data] == ["m · trial 0", "m · trial 1"]
    one = latency_cdf_figure(trial(0, 2.0))
    assert [t.name for t in one.data] == ["m"]  # one trial: the tenant's name alone


@pytest.mark.parametrize("name", ["x.png", "report.svg", "report"])
def test_a_report_to_a_file_not_named_html_is_refused(name, capsys, tmp_path):
    """`-o x.png` used to write HTML into x.png; the report is HTML only (plotly's static
    images need kaleido, no dependency of gpulens)."""
    assert main(["report", str(JPEG), "-o", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert "must end in .html" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_a_folder_with_a_damaged_run_json_is_reported_without_it_and_says_so(tmp_path, capsys):
    """`gpulens report FOLDER`: a half-written run.json is skipped with a warning naming it and
    the fix; the other runs are reported."""
    folder = tmp_path / "runs"
    shutil.copytree(JPEG, folder / "20261122-035651-9e46cf")
    bad = folder / "20261128-100000-aaaaaa"
    bad.mkdir()
    (bad / "run.json").write_text((JPEG / "run.json").read_text()[:200])
    out = tmp_path / "r.html"
    assert main(["report", str(folder), "-o", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["skipped"] == [str(bad)]
    assert "skipped" in captured.err and str(bad) in captured.err and "Fix:" in captured.err
    assert out.is_file()
    shutil.rmtree(folder / "20261122-035651-9e46cf")  # only damaged records: one clear error
    assert main(["report", str(folder), "-o", str(tmp_path / "s.html")]) != 0
    err = capsys.readouterr().err
    assert "is damaged" in err and "Traceback" not in err
    assert not (tmp_path / "s.html").exists()


def test_stall_runs_of_two_experiments_get_a_breakdown_each_never_pooled(tmp_path):
    """A folder holding the runs of two `gpulens stalls` (another workload and device) gives
    two breakdowns; the H100 one is the stored breakdown, untouched by the other's runs."""
    stored = json.loads(next(RESULTS.glob("stalls-*-s8-8339c1c-*.json")).read_text())["result"]
    h100 = [read_record(p) for p in sorted(STALLS.iterdir())]
    other = []
    for run in sorted(STALLS.iterdir())[:2]:  # its ingestion-free and cached runs
        meta = json.loads((run / "run.json").read_text())
        meta["run_id"] = meta["run_id"][:-6] + "cpu000"
        meta["summary"].update(workload="tiny_cnn", gpu={}, throughput_samples_per_s=100.0)
        meta["summary"]["phases_s"] = {"step": 0.3}
        meta["effective_config"].update(workload="tiny_cnn", device="cpu")
        meta["environment"].pop("gpu_model", None)
        other.append(RunRecord(tmp_path, meta))
    sections = document.build_report(h100 + other)
    stalls = [s for s in sections if s.title.startswith("stall breakdown")]
    assert [s.title for s in stalls] == [
        "stall breakdown: resnet50 on NVIDIA H100 80GB HBM3 (bf16, batch 128)",
        "stall breakdown: tiny_cnn on cpu (bf16, batch 128)",
    ]
    bars = {t.name: t for t in stalls[0].figures[0].data}
    for part in ("compute", "prep_stall", "fetch_stall"):
        assert bars[part.replace("_", " ")].x[0] == pytest.approx(stored["breakdown_pct"][part])


def test_a_training_run_beside_a_colocate_run_keeps_its_figures_and_says_why_no_table(tmp_path):
    """`gpulens report TRAIN COLOCATE`: the training run's step-time distribution stays in its
    own section (it landed under the colocate run's heading), and the page says why there is
    no comparison table."""
    colocate = RunRecord(tmp_path, {
        "run_id": "c", "name": "colo", "kind": "colocate", "status": "finished",
        "summary": {"colocate": json.loads(COLOCATE.read_text())["result"]},
    })  # fmt: skip
    for records in ([read_record(JPEG), colocate], [colocate, read_record(JPEG)]):
        sections = document.build_report(records)
        first, *runs = sections
        assert first.title == "comparison" and first.table is None
        assert "these are colocate, train runs" in first.notes[0]
        train = next(s for s in runs if "(train," in s.title)
        colo = next(s for s in runs if "(colocate," in s.title)
        assert [f.layout.title.text.split(" (")[0] for f in train.figures] == [
            "GPU and steps over time", "step time distribution"]  # fmt: skip
        assert not any("step time" in f.layout.title.text for f in colo.figures)


def test_a_colocate_run_draws_the_mechanisms_measured_and_says_why_the_others_are_not():
    """On a CPU only time-slicing runs: streams, MPS and MIG get no empty column in the figures
    but a note with the reason, as the terminal prints it."""
    doc = json.loads(COLOCATE.read_text())["result"]
    why = "unavailable: MIG needs an NVIDIA GPU"
    skipped = {**doc["results"][1], "mechanism": "mig", "setting": "existing instances",
               "status": "unavailable", "error": why}  # fmt: skip
    skipped["jobs"] = [{**j, "throughput_together": None, "slowdown": None}
                       for j in skipped["jobs"]]  # fmt: skip
    doc = {**doc, "results": [*doc["results"], skipped]}
    record = RunRecord(Path("."), {"run_id": "c", "kind": "colocate", "status": "finished",
                                   "summary": {"colocate": doc}})  # fmt: skip
    section = document.colocate_section(record)

    def _lab(r):
        return r["mechanism"] + (f" {r['setting']}" if r["setting"] != "default" else "")

    bars, heat, combined = section.figures
    assert [str(x) for x in heat.data[0].x] == [_lab(r) for r in doc["results"][:5]]
    assert all(None not in list(t.y) for t in combined.data)
    assert "mig existing instances: unavailable: MIG needs an NVIDIA GPU" in section.notes


def test_a_run_killed_before_its_summary_says_why_its_table_is_empty(tmp_path):
    """Ctrl-C before the summary: every fact is n/a while the timeline shows the steps taken;
    the section says why."""
    meta = json.loads((JPEG / "run.json").read_text())
    meta.update(status="killed", summary={}, error="interrupted (Ctrl-C)")
    shutil.copytree(JPEG, tmp_path / "run")
    section = document.run_section(RunRecord(tmp_path / "run", meta))
    assert section.figures and ("throughput samples/s", "n/a") in section.facts
    assert section.notes[0].startswith("this run ended (killed) before it had a summary")


def test_a_running_run_says_its_table_fills_in_when_it_ends(tmp_path):
    meta = json.loads((JPEG / "run.json").read_text())
    meta.update(status="running", summary={})
    shutil.copytree(JPEG, tmp_path / "run")
    section = document.run_section(RunRecord(tmp_path / "run", meta))
    assert section.notes[0] == (
        "this run is still running: the table above fills in when it ends: the figures show "
        "what it has recorded so far"
    )


def test_a_run_on_two_gpus_draws_each_gpu_on_one_time_axis(tmp_path):
    """A 2-GPU run: the report drew GPU 0 only, and said nothing of GPU 1."""
    gpu = read_record(JPEG).series("gpu")
    other = gpu.assign(gpu_index=1, gpu_util_pct=gpu["gpu_util_pct"] / 2)
    run = tmp_path / "run"
    shutil.copytree(JPEG, run)
    pd.concat([gpu, other]).to_parquet(run / "series" / "gpu.parquet")
    section = document.run_section(read_record(run))
    first, second = section.figures[:2]
    assert first.layout.title.text == "GPU 0 and steps over time" and _traces(first, "bar")
    assert second.layout.title.text == "GPU 1 over time" and not _traces(second, "bar")
    util = [
        next(t for t in f.data if t.name.startswith("GPU utilization")) for f in (first, second)
    ]
    assert list(util[1].y) == list(gpu["gpu_util_pct"] / 2)
    assert list(util[0].x) == list(util[1].x)  # one time origin for both


def test_the_step_row_of_a_run_of_two_ranks_draws_one_rank(tmp_path):
    """torchrun with 2 ranks: both ranks' steps were drawn as one row of overlapping bars (and
    an hour's bins could straddle the ranks)."""
    steps = read_record(JPEG).series("steps")
    both = pd.concat([steps.assign(rank=0), steps.assign(rank=1, compute_s=steps["compute_s"] * 2)])
    run = tmp_path / "run"
    shutil.copytree(JPEG, run)
    both.to_parquet(run / "series" / "steps.parquet")
    section = document.run_section(read_record(run))
    compute = next(t for t in section.figures[0].data if t.name == "compute")
    measured = steps[~steps["warmup"]]
    assert list(compute.y) == pytest.approx(list(1000 * measured["compute_s"]))
    assert "rank 0's steps, of 2 ranks" in " ".join(section.notes)


def test_a_wrapped_torchrun_command_counts_its_ranks_as_processes():
    """`gpulens run -- torchrun --nproc_per_node 2 ...` said 'n/a x 1' processes."""
    summary = {"ranks": [{"rank": 0}, {"rank": 1}], "throughput_samples_per_s": 1.0}
    record = RunRecord(Path("."), {"run_id": "x", "kind": "command", "status": "finished",
                                   "summary": summary})  # fmt: skip
    assert ("batch size x processes", "n/a x 2") in document.run_section(record).facts


def test_a_run_named_twice_is_reported_once(tmp_path, capsys):
    """`gpulens report RUN FOLDER-HOLDING-RUN`: the run was compared with itself."""
    out = tmp_path / "r.html"
    first = sorted(STALLS.iterdir())[0]
    assert main(["report", str(first), str(STALLS), str(first), "-o", str(out), "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert runs == [first.name] + [p.name for p in sorted(STALLS.iterdir())[1:]]


def test_a_damaged_series_file_is_a_note_and_the_rest_is_reported(tmp_path, capsys):
    """A truncated gpu.parquet in one run of a folder stopped the whole report (exit 1)."""
    folder = tmp_path / "runs"
    shutil.copytree(JPEG, folder / "20261122-035651-9e46cf")
    gpu = folder / "20261122-035651-9e46cf" / "series" / "gpu.parquet"
    gpu.write_bytes(gpu.read_bytes()[:1000])
    out = tmp_path / "r.html"
    assert main(["report", str(folder), "-o", str(out)]) == 0
    page = out.read_text()
    assert "gpu series not drawn" in page and "Fix:" in page
    assert "step time distribution" in page  # the steps still drawn
