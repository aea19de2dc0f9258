"""Terminal tables for ``gpulens colocate`` and ``gpulens colocate --plan``."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from gpulens.colocate.metrics import energy_unit, throughput_units
from gpulens.report.terminal import COMPACT


def _num(value: Any, fmt: str = "{:,.1f}") -> str:
    return "[dim]n/a[/dim]" if value is None else fmt.format(value)


def _rate(value: float | None) -> str:
    """A throughput: one decimal, or two significant digits below 1 (a command's runs/s)."""
    if value is None:
        return "[dim]n/a[/dim]"
    return f"{value:,.1f}" if abs(value) >= 1 else f"{value:.2g}"


def _throughput(value: float | None, unit: str | None, shared: str | None) -> dict[str, Any]:
    """A job's throughput cells: under its unit when every job counts the same thing, else
    the figure and its unit side by side (training counts samples, an inference tenant
    requests, a cmd: job whole runs)."""
    if shared:
        return {shared: _rate(value)}
    return {"throughput": _rate(value), "unit": Text(unit or "")}


def _energy(value: float | None, unit: str | None, shared: str | None) -> dict[str, Any]:
    """A job's energy alone: under its unit (J/sample, J/request, J/run) when every job counts
    the same thing, else the figure with its unit in the cell."""
    if shared:
        return {energy_unit(shared) or "J/unit": _num(value, "{:.3f}")}
    return {"energy": _num(value, "{:.3f} " + (energy_unit(unit) or "J/unit"))}


def _ms(value_s: float | None) -> str:
    return "[dim]n/a[/dim]" if value_s is None else f"{1000 * value_s:,.1f}"


def render_colocate(console: Console, doc: dict[str, Any]) -> None:
    gpu = doc.get("gpu") or {}
    where = gpu.get("name") or doc.get("device") or "?"
    console.print(
        f"[bold]collocation on {escape(str(where))}[/bold] · {doc.get('duration_s')} s per run"
    )
    # a job's full key (kind:workload:options) would squeeze the alone table's figures in 80
    # columns: it gets a line of its own
    width = max(len(str(j["name"])) for j in doc["jobs"])
    for j in doc["jobs"]:
        console.print(Text.assemble(f"  {str(j['name']):<{width}}  ", (str(j["key"]), "dim")))
    units = throughput_units(doc)
    shared = next(iter(units.values())) if len(set(units.values())) == 1 else None
    alone_rows = []
    for j in doc["jobs"]:
        mem = j.get("peak_mem_bytes")
        alone_rows.append({
            "job": Text(str(j["name"])),
            **_throughput(j.get("throughput_alone"), units.get(str(j["name"])), shared),
            "p50 ms": _ms(j.get("step_time_p50_alone_s")),
            "p99 ms": _ms(j.get("step_time_p99_alone_s")),
            "mem GiB": _num(mem / 2**30 if mem else None, "{:.2f}"),
            **_energy(_alone_energy(j), units.get(str(j["name"])), shared),
        })  # fmt: skip
    console.print(_table("alone (p50/p99: step time, or latency of inference)", alone_rows,
                         left=("job", "unit")))  # fmt: skip
    groups, rows, not_measured = [], [], []
    for r in doc["results"]:
        if r["status"] != "ok":  # one line each below the tables: an error fits no column
            not_measured.append(r)
            continue
        # what belongs to the group and what to each job go in two tables: nine columns side
        # by side do not fit an 80-column terminal without folding the labels to pieces
        label = f"{r['mechanism']} · {r['setting']}"
        groups.append({
            "mechanism": Text(label),
            "aggregate": _num(r.get("normalized_aggregate_throughput"), "{:.2f}x"),
            "Jain": _num(r.get("jain_fairness"), "{:.2f}"),
            # per unit only when every job counts the same thing; against the jobs alone always
            energy_unit(shared) or "J/unit": _num(_group_energy(r) if shared else None, "{:.3f}"),
            "energy vs alone": _num(r.get("energy_vs_alone_ratio"), "{:.2f}x"),
            "SM %": _num(r.get("sm_activity_pct"), "{:.0f}"),
        })  # fmt: skip
        # the jobs' units beside their names, not in a column of their own: the mechanism
        # labels share the first column and folded (on an H200, 80 columns) with one more
        figure = shared or "throughput"
        rows.append({"mechanism / job": Text(label, style="bold"), figure: "",
                     "slowdown": "", "p50 ms": "", "p99 ms": ""})  # fmt: skip
        for i, j in enumerate(r["jobs"]):
            name, unit = str(j["name"]), units.get(str(j["name"]))
            rows.append({
                "mechanism / job": Text(f"  {name}" + ("" if shared or not unit else f" ({unit})")),
                figure: _rate(j.get("throughput_together")),
                "slowdown": _num(j.get("slowdown"), "{:.2f}x"),
                "p50 ms": _ms(j.get("step_time_p50_s")), "p99 ms": _ms(j.get("step_time_p99_s")),
                "_end": i == len(r["jobs"]) - 1,
            })  # fmt: skip
    if groups:
        energy = any(r.get("energy_vs_alone_ratio") is not None for r in doc["results"])
        console.print(_table("together: each mechanism (aggregate: the sum of together/alone"
                             + ("; energy vs alone: GPU energy for the work / the jobs alone)"
                                if energy else ")"), groups, left=("mechanism",)))  # fmt: skip
        console.print(_table("together: each job", rows, left=("mechanism / job",)))
    for r in not_measured:
        error = str(r.get("error") or "not measured")
        status = "" if error.startswith(str(r["status"])) else f"{r['status']}: "
        console.print(Text.assemble((f"{r['mechanism']} {r['setting']}: ", "yellow"),
                                    status + error))  # fmt: skip
    _render_slo(console, doc)
    for w in doc.get("warnings") or []:
        console.print(Text.assemble(("warning: ", "yellow"), str(w)))
    console.print(Text.assemble(("recommendation: ", "bold"), str(doc["recommendation"])))
    if doc.get("run_id"):
        console.print(Text(f"stored as run {doc['run_id']}", style="dim"))


def _render_slo(console: Console, doc: dict[str, Any]) -> None:
    """Inference tenants with an SLO: attainment alone and together, and what training kept."""
    rows = [(r, j) for r in doc["results"] if r["status"] == "ok" for j in r["jobs"]
            if j.get("slo_ms") is not None]  # fmt: skip
    if not rows:
        return
    table = Table(title="SLO attainment (inference) and throughput kept (training)",
                  title_justify="left", **COMPACT)  # fmt: skip
    for col in ("mechanism", "setting", "tenant", "SLO ms", "alone", "together", "lost pp",
                "training kept"):  # fmt: skip
        text = col in ("mechanism", "setting", "tenant")
        table.add_column(col, justify="left" if text else "right",
                         overflow="fold", no_wrap=not text)  # fmt: skip
    for r, j in rows:
        kept = [t for t in r["jobs"] if t.get("kind") == "train" and t.get("slowdown")]
        table.add_row(
            Text(str(r["mechanism"])), Text(str(r["setting"])), Text(str(j["name"])),
            f"{j['slo_ms']:g}", _num(_pct(j.get("slo_attainment_alone")), "{:.1f}%"),
            _num(_pct(j.get("slo_attainment")), "{:.1f}%"),
            _num(j.get("slo_attainment_lost_pp"), "{:+.1f}"),
            ", ".join(f"{t['name']} {100 / t['slowdown']:.0f}%" for t in kept) or "-",
        )  # fmt: skip
    console.print(table)


def _table(title: str, rows: list[dict[str, Any]], left: tuple[str, ...]) -> Table:
    """A compact table of ``rows`` (header -> cell); a column that is n/a in every row (energy
    on a CPU, say) is left out, so the rest fit an 80-column terminal. ``_end`` closes a
    section."""
    headers = [h for h in rows[0] if h != "_end"]
    shown = [h for h in headers if any(str(r[h]) not in ("[dim]n/a[/dim]", "") for r in rows)]
    table = Table(title=title, title_justify="left", **COMPACT)
    for h in shown:  # names fold onto more lines; figures are never cut (no_wrap keeps their
        # width while the names' columns give way)
        if h in left:
            table.add_column(h, justify="left", overflow="fold")
        else:
            table.add_column(h, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(*(r[h] for h in shown), end_section=bool(r.get("_end")))
    return table


def _alone_energy(job: dict[str, Any]) -> float | None:
    """A job's energy per unit alone; a document written before ``energy_per_unit_alone_j``
    has it as ``energy_per_sample_alone_j`` (then per run for a cmd: job)."""
    if "energy_per_unit_alone_j" in job:
        return job["energy_per_unit_alone_j"]
    return job.get("energy_per_sample_alone_j")


def _group_energy(result: dict[str, Any]) -> float | None:
    """A mechanism's energy per unit when the jobs count one thing (``energy_per_sample_j`` in
    a document written before ``energy_per_unit_j``)."""
    if "energy_per_unit_j" in result:
        return result["energy_per_unit_j"]
    return result.get("energy_per_sample_j")


def _pct(share: float | None) -> float | None:
    return None if share is None else 100 * share


def render_plan(console: Console, doc: dict[str, Any]) -> None:
    for title, p in (("plan (greedy)", doc["plan"]), ("best by exhaustive search",
                                                       doc["exhaustive"])):  # fmt: skip
        table = Table(
            title=f"{title}: {p['gpus']} GPU(s), {p['normalized_throughput_per_gpu']:.2f}x per GPU",
            title_justify="left",
        )
        for col in ("jobs", "mechanism", "setting", "aggregate", "worst slowdown"):
            number = col in ("aggregate", "worst slowdown")
            table.add_column(col, justify="right" if number else "left",
                             overflow="fold", no_wrap=number)  # fmt: skip
        for g in p["groups"]:
            table.add_row(Text(" + ".join(g["jobs"])), Text(g["mechanism"]),
                          Text(g["setting"] or ""),
                          f"{g['normalized_aggregate_throughput']:.2f}x",
                          f"{g['max_slowdown']:.2f}x")  # fmt: skip
        console.print(table)
    q = doc.get("quality")
    console.print(f"plan quality: {_num(100 * q if q is not None else None, '{:.0f}%')} of the "
                  f"exhaustive best ({doc['measured_groups']} measured group(s))")  # fmt: skip
    console.print(Text.assemble(("recommendation: ", "bold"), str(doc["recommendation"])))
