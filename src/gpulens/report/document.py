"""What a report shows for a set of run records: sections of facts, figures and notes.

Which figures for which run:
- every run with a GPU or step series: its timeline (GPU activity, memory, power, SM clock,
  step phases beneath) and a table of its summary;
- every run with loader prep timing: time per sample per stage and worker;
- all runs with steps together: the step-time distribution (overlaid);
- the stall runs among them (role ``stalls:*``): the stall breakdown with 95% intervals;
- a colocate experiment: alone vs together, the slowdown heat map, combined throughput and
  fairness;
- a serving run (``gpulens serve`` / ``gpulens load``): per model or tenant latency against the
  SLO, latency over time and its distribution, the batch sizes served;
- two runs or more: one comparison table, differences from the first run marked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from gpulens.errors import DamagedRecordError
from gpulens.record.labels import workload_label
from gpulens.record.reader import RunRecord, first_rank_steps, rank_ids, read_prep
from gpulens.report import figures, serving

# A difference from the first run is marked when it exceeds both intervals' half-widths, or
# this share where no interval is known.
MARK_WITHOUT_CI = 0.05
# The runs every stall breakdown needs: the GPU fed from memory, and the loader from cache.
STALL_BASE_ROLES = ("ingestion_free", "cached")


@dataclass
class Section:
    title: str
    facts: list[tuple[str, str]] = field(default_factory=list)
    figures: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # A comparison: column headers, rows of cells, and which cells to mark.
    table: list[list[str]] | None = None
    marked: set[tuple[int, int]] = field(default_factory=set)


def _fmt(value: Any, spec: str = "{:,.1f}", scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return spec.format(value * scale)


def _labels(records: list[RunRecord]) -> list[str]:
    """Run names, with the run id's end added where two runs share a name."""
    names = [str(r.meta.get("name") or r.run_id) for r in records]
    return [
        f"{n} ({r.run_id[-6:]})" if names.count(n) > 1 else n
        for n, r in zip(names, records, strict=True)
    ]


def _title(record: RunRecord) -> str:
    meta = record.meta
    name = meta.get("name") or record.run_id
    return f"{name} ({meta.get('kind', 'run')}, {record.status}) · {record.run_id}"


def _facts(record: RunRecord) -> list[tuple[str, str]]:
    s = record.meta.get("summary") or {}
    env = record.meta.get("environment") or {}
    gpu = s.get("gpu") or {}
    phases = s.get("phases_s") or {}
    tput = s.get("throughput_samples_per_s")
    ci = s.get("throughput_ci95_pct")
    # a wrapped torchrun command keeps its ranks' summaries under "ranks", no "processes"
    processes = s.get("processes") or len(s.get("ranks") or []) or 1
    facts = [
        ("workload", str(workload_label(record.meta) or record.meta.get("name") or "n/a")),
        ("device", str(gpu.get("name") or env.get("gpu_model") or s.get("device") or "n/a")),
        ("batch size x processes", f"{s.get('batch_size', 'n/a')} x {processes}"),
        ("precision", str(s.get("precision") or "n/a")),
        ("throughput samples/s", _fmt(tput) + (f" ± {ci:.1f}%" if ci else "")),
        ("step ms", _fmt(phases.get("step"), scale=1000, spec="{:,.2f}")),
        (
            "data wait / copy / compute ms",
            " / ".join(
                _fmt(phases.get(p), scale=1000, spec="{:,.2f}")
                for p in ("data_wait", "h2d", "compute")
            ),
        ),  # fmt: skip
        (
            "GPU util / SM activity %",
            f"{_fmt(gpu.get('gpu_util_pct'))} / {_fmt(gpu.get('sm_activity_pct'))}",
        ),  # fmt: skip
        ("MFU %", _fmt(s.get("mfu"), scale=100)),
        ("energy J/sample", _fmt(gpu.get("energy_per_sample_j"), "{:.3f}")),
        ("measured steps", str(s.get("measured_steps", "n/a"))),
        ("stop reason", str(s.get("stop_reason") or "n/a")),
    ]
    if record.meta.get("error"):
        facts.append(("error", str(record.meta["error"])))
    return facts


def _series(record: RunRecord, name: str, notes: list[str] | None = None) -> pd.DataFrame | None:
    """The series, or None when absent, empty or damaged (then what is wrong goes to ``notes``:
    one damaged file must not stop the report of the rest)."""
    if name not in record.series_names():
        return None
    try:
        df = record.series(name)
    except DamagedRecordError as exc:
        if notes is not None:
            notes.append(f"{name} series not drawn: {exc}")
        return None
    return df if not df.empty else None


def run_section(record: RunRecord) -> Section:
    """One run: its summary facts, timeline and (with prep timing) its loader stages."""
    section = Section(_title(record), facts=_facts(record))
    gpu, steps = _series(record, "gpu", section.notes), _series(record, "steps", section.notes)
    ranks = rank_ids(steps) if steps is not None else []
    if len(ranks) > 1:  # the ranks' bars would overlap on one time axis: the first rank's
        steps = first_rank_steps(steps)
        section.notes.append(f"the step row shows rank {ranks[0]}'s steps, of {len(ranks)} ranks "
                             "(load_series(run, 'steps') has every rank's)")  # fmt: skip
    indices = sorted({int(i) for i in gpu["gpu_index"].dropna()}) if (
        gpu is not None and "gpu_index" in gpu) else []  # fmt: skip
    if len(indices) < 2:
        timeline = figures.timeline_figure(gpu, steps, "GPU and steps over time")
        section.figures += [timeline] if timeline is not None else []
    else:  # every GPU of the run, on one time axis; the steps beneath the first
        starts = [gpu["time_unix_s"].min()]
        if steps is not None and "step_time_s" in steps:
            starts.append((steps["time_unix_s"] - steps["step_time_s"]).min())
        t0 = float(min(starts))
        for n, index in enumerate(indices):
            title = f"GPU {index} and steps over time" if n == 0 else f"GPU {index} over time"
            fig = figures.timeline_figure(gpu, steps if n == 0 else None, title, index, t0)
            section.figures += [fig] if fig is not None else []
    if not section.figures:
        section.notes.append("no GPU or step series in this record")
    prep = read_prep(record.dir)
    prep_fig = figures.prep_figure(prep if not prep.empty else None, "loader stages per worker")
    if prep_fig is not None:
        section.figures.append(prep_fig)
    if not record.meta.get("summary"):
        shown = ": the figures show what it recorded" if section.figures else ""
        if record.status == "running":
            so_far = shown.replace("recorded", "has recorded so far")
            section.notes.append("this run is still running: the table above fills in when it "
                                 f"ends{so_far}")  # fmt: skip
        else:
            section.notes.append(f"this run ended ({record.status}) before it had a summary, so "
                                 f"the table above is empty{shown}")  # fmt: skip
    for kind, why in (record.meta.get("unsupported") or {}).items():
        section.notes.append(f"{kind} not measured: {why}")
    return section


def serving_section(record: RunRecord) -> Section:
    """A ``gpulens serve`` or ``gpulens load`` run: per model or tenant figures, the latency
    percentiles against the SLO, latency over time, and the batch sizes served."""
    summary = record.meta.get("summary") or {}
    section = Section(_title(record))
    if record.meta.get("kind") == "load":
        section.facts = serving.load_facts(summary)
        requests = _series(record, "requests", section.notes)
        builders = (
            serving.latency_percentile_figure(summary),
            serving.latency_over_time_figure(requests),
            serving.latency_cdf_figure(requests),
        )
        section.notes += [str(n) for n in summary.get("generator_notes") or []]
    else:
        section.facts = serving.serve_facts(summary, record.meta.get("effective_config") or {})
        builders = (serving.batch_size_figure(_series(record, "batches", section.notes)),)
    section.figures = [f for f in builders if f is not None]
    gpu = _series(record, "gpu", section.notes)
    timeline = figures.timeline_figure(gpu, None, "GPU while serving")
    if timeline is not None:
        section.figures.append(timeline)
    if not summary:
        section.notes.append("this run ended before it had a summary")
    for kind, why in (record.meta.get("unsupported") or {}).items():
        section.notes.append(f"{kind} not measured: {why}")
    return section


def colocate_section(record: RunRecord) -> Section:
    doc = (record.meta.get("summary") or {}).get("colocate") or {}
    section = Section(_title(record))
    gpu = doc.get("gpu") or {}
    section.facts = [
        ("GPU", str(gpu.get("name") or doc.get("device") or "n/a")),
        ("jobs", ", ".join(j.get("key", j.get("name", "?")) for j in doc.get("jobs") or [])),
        ("seconds per run", str(doc.get("duration_s", "n/a"))),
    ]
    section.facts += colocate_energy_facts(doc)
    if doc.get("recommendation"):
        section.facts.append(("recommendation", str(doc["recommendation"])))
    section.figures = figures.colocate_figures(doc)
    for r in doc.get("results") or []:
        if r.get("status") not in (None, "ok"):  # as the terminal says it, one line each
            error = str(r.get("error") or "not measured")
            status = "" if error.startswith(str(r["status"])) else f"{r['status']}: "
            section.notes.append(f"{r.get('mechanism')} {r.get('setting')}: {status}{error}")
    section.notes += [str(w) for w in doc.get("warnings") or []]
    if not section.figures:
        section.notes.append("no mechanism was measured together: nothing to compare")
    return section


def colocate_energy_facts(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """GPU energy, each job alone in its own unit (J/sample, J/request, J/run), and each
    mechanism against the jobs alone (per unit too when every job counts the same thing);
    nothing where energy was not measured (a CPU run)."""
    from gpulens.colocate.metrics import energy_unit, throughput_units

    units = throughput_units(doc)
    alone = []
    for j in doc.get("jobs") or []:
        value = j.get("energy_per_unit_alone_j", j.get("energy_per_sample_alone_j"))
        unit = j.get("energy_unit") or energy_unit(units.get(str(j.get("name"))))
        if value is not None:
            alone.append(f"{j.get('name')} {value:.3f} {unit or 'J/unit'}")
    together = []
    for r in doc.get("results") or []:
        ratio, per_unit = r.get("energy_vs_alone_ratio"), r.get("energy_per_unit_j")
        if r.get("status") not in (None, "ok") or (ratio is None and per_unit is None):
            continue
        parts = [
            f"{ratio:.2f}x the jobs alone" if ratio is not None else None,
            f"{per_unit:.3f} {r.get('energy_unit')}" if per_unit is not None else None,
        ]
        together.append(f"{figures.setting_label(r)}: "
                        + ", ".join(p for p in parts if p))  # fmt: skip
    facts = []
    if alone:
        facts.append(("GPU energy alone", "; ".join(alone)))
    if together:
        facts.append(("GPU energy together", "; ".join(together)))
    return facts


def stall_section(records: list[RunRecord]) -> Section | None:
    """The breakdown over the stall runs given (one experiment's runs)."""
    from gpulens.stalls import StallAnalysis

    analysis = StallAnalysis.from_results(r.result() for r in records)
    if not analysis.runs:
        return None
    missing = [role for role in STALL_BASE_ROLES if role not in analysis.runs]
    if missing:
        return Section("stall breakdown", notes=[
            f"no breakdown: the runs given include no {' or '.join(missing)} run; give all the "
            "runs of one `gpulens stalls` (e.g. the folder they are in)"
        ])  # fmt: skip
    breakdown = analysis.breakdown()
    section = Section("stall breakdown", notes=list(breakdown.get("notes") or []))
    shares, cis = breakdown.get("breakdown_pct") or {}, breakdown.get("breakdown_ci95_pp") or {}
    section.facts = [
        (part.replace("_", " "), f"{share:.1f}% ± {cis.get(part, float('nan')):.1f} pp")
        for part, share in shares.items()
        if share is not None
    ]
    section.facts += [(f"{role} runs", ", ".join(ids)) for role, ids in breakdown["runs"].items()]
    workload = next((r.meta.get("summary", {}).get("workload") for r in records), None)
    fig = figures.stall_figure({str(workload or "runs"): breakdown})
    if fig is not None:
        section.figures.append(fig)
        # `gpulens stalls` keeps its what-if predictions in its runs' summaries
        what_if = next((r.meta["summary"]["stalls_what_if"] for r in records
                        if (r.meta.get("summary") or {}).get("stalls_what_if")), None)  # fmt: skip
        curves = figures.what_if_figure(what_if) if what_if else None
        if curves is not None:
            section.figures.append(curves)
    else:
        section.notes.append(
            "the breakdown needs an ingestion-free and a cached run at least: run `gpulens stalls`"
        )
    return section


def _stall_setup(record: RunRecord) -> tuple[str, ...]:
    """What one `gpulens stalls` experiment's runs share (its runs differ in data, workers and
    GPU count by design): workload, GPU (or device), precision and batch size."""
    s, eff = record.meta.get("summary") or {}, record.meta.get("effective_config") or {}
    env = record.meta.get("environment") or {}
    device = (s.get("gpu") or {}).get("name") or env.get("gpu_model") or eff.get("device")
    workload, precision = s.get("workload") or eff.get("workload"), s.get("precision")
    setup = (workload, device, precision or eff.get("precision"),
             s.get("batch_size") or eff.get("batch_size"))  # fmt: skip
    return tuple(str(v if v is not None else "n/a") for v in setup)


COMPARED = (
    ("throughput samples/s", ("throughput_samples_per_s",), "throughput_ci95_pct", 1.0),
    ("step ms", ("phases_s", "step"), None, 1000.0),
    ("data wait ms", ("phases_s", "data_wait"), None, 1000.0),
    ("GPU util %", ("gpu", "gpu_util_pct"), None, 1.0),
    ("SM activity %", ("gpu", "sm_activity_pct"), None, 1.0),
    ("MFU %", ("mfu",), None, 100.0),
    ("energy J/sample", ("gpu", "energy_per_sample_j"), None, 1.0),
)


def _get(doc: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc


def comparison_section(records: list[RunRecord]) -> Section:
    """Key figures of each run side by side; a cell is marked where it differs from the first
    run by more than the runs' intervals (or 5% where there is none)."""
    labels = _labels(records)
    header = ["", *labels]
    rows: list[list[str]] = [header]
    marked: set[tuple[int, int]] = set()
    for i, (label, path, ci_key, scale) in enumerate(COMPARED, start=1):
        values = [_get(r.meta.get("summary") or {}, path) for r in records]
        cis = [(r.meta.get("summary") or {}).get(ci_key) if ci_key else None for r in records]
        row = [label]
        for j, v in enumerate(values):
            cell = _fmt(v, "{:,.2f}", scale)
            base = values[0]
            if j and isinstance(v, (int, float)) and isinstance(base, (int, float)) and base:
                change = v / base - 1
                cell += f" ({100 * change:+.1f}%)"
                limit = (
                    ((cis[0] or 0) + (cis[j] or 0)) / 100 if cis[0] and cis[j] else MARK_WITHOUT_CI
                )
                if abs(change) > limit:
                    marked.add((i, j + 1))
            row.append(cell)
        rows.append(row)
    section = Section("comparison", table=rows, marked=marked)
    step_times = {}
    for label, r in zip(labels, records, strict=True):
        steps = _series(r, "steps")
        if steps is not None:  # each step once: the first rank's, as the run section draws
            steps = first_rank_steps(steps)
            measured = steps[~steps["warmup"].astype(bool)] if "warmup" in steps else steps
            step_times[label] = 1000 * measured["step_time_s"]
    fig = figures.step_time_figure(step_times)
    if fig is not None:
        section.figures.append(fig)
    return section


# Runs that are not training runs: a section of their own, and no place in the comparison.
SECTION_OF_KIND = {"colocate": colocate_section, "serve": serving_section, "load": serving_section}


def build_report(records: list[RunRecord]) -> list[Section]:
    """The sections for these records, in the order given; a comparison first for several."""
    runs = [r for r in records if r.meta.get("kind") not in SECTION_OF_KIND]
    sections: list[Section] = []
    if len(runs) >= 2:
        sections.append(comparison_section(runs))
    stall_runs = [r for r in runs if str(r.meta.get("role") or "").startswith("stalls:")]
    experiments: dict[tuple[str, ...], list[RunRecord]] = {}
    for r in stall_runs:  # runs of different experiments are never pooled into one breakdown
        experiments.setdefault(_stall_setup(r), []).append(r)
    for setup, group in experiments.items():
        stall = stall_section(group)
        if stall is not None:
            if len(experiments) > 1:
                workload, device, precision, batch = setup
                stall.title += f": {workload} on {device} ({precision}, batch {batch})"
            sections.append(stall)
    for r in records:
        sections.append(SECTION_OF_KIND.get(r.meta.get("kind"), run_section)(r))
        if len(runs) == 1 and r is runs[0]:  # the step-time distribution of the one run
            sections[-1].figures += comparison_section(runs).figures
    if len(records) > 1 and len(runs) < 2:
        kinds = ", ".join(sorted({str(r.meta.get("kind")) for r in records}))
        sections.insert(0, Section("comparison", notes=[
            f"no comparison table: it needs two runs that train or run a command, and these "
            f"are {kinds} runs; each is shown on its own below"
        ]))  # fmt: skip
    return sections
