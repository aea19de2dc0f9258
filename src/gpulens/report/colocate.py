"""Terminal tables for ``gpulens colocate`` and ``gpulens colocate --plan``."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text


def _num(value: Any, fmt: str = "{:,.1f}") -> str:
    return "[dim]n/a[/dim]" if value is None else fmt.format(value)


def _ms(value_s: float | None) -> str:
    return "[dim]n/a[/dim]" if value_s is None else f"{1000 * value_s:,.1f}"


def render_colocate(console: Console, doc: dict[str, Any]) -> None:
    gpu = doc.get("gpu") or {}
    where = gpu.get("name") or doc.get("device") or "?"
    console.print(
        f"[bold]collocation on {escape(str(where))}[/bold] · {doc.get('duration_s')} s per run"
    )
    alone = Table(title="alone", title_justify="left")
    for col in ("job", "what", "samples/s", "step p50 ms", "step p99 ms", "peak mem GiB",
                "J/sample"):  # fmt: skip
        alone.add_column(col, justify="left" if col in ("job", "what") else "right")
    for j in doc["jobs"]:
        mem = j.get("peak_mem_bytes")
        alone.add_row(
            Text(str(j["name"])), Text(str(j["key"])), _num(j.get("throughput_alone")),
            _ms(j.get("step_time_p50_alone_s")), _ms(j.get("step_time_p99_alone_s")),
            _num(mem / 2**30 if mem else None, "{:.2f}"),
            _num(j.get("energy_per_sample_alone_j"), "{:.3f}"),
        )  # fmt: skip
    console.print(alone)
    table = Table(title="together", title_justify="left")
    for col in ("mechanism", "setting", "job", "samples/s", "slowdown", "step p50 ms",
                "step p99 ms", "aggregate", "Jain", "J/sample", "SM act %"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("mechanism", "setting", "job") else "right")
    for r in doc["results"]:
        if r["status"] != "ok":
            table.add_row(
                Text(str(r["mechanism"])),
                Text(str(r["setting"])),
                Text(str(r["error"]), style="yellow"),
            )
            continue
        for i, j in enumerate(r["jobs"]):
            first = i == 0
            table.add_row(
                Text(str(r["mechanism"])) if first else "",
                Text(str(r["setting"])) if first else "", Text(str(j["name"])),
                _num(j.get("throughput_together")), _num(j.get("slowdown"), "{:.2f}x"),
                _ms(j.get("step_time_p50_s")), _ms(j.get("step_time_p99_s")),
                _num(r.get("normalized_aggregate_throughput"), "{:.2f}x") if first else "",
                _num(r.get("jain_fairness"), "{:.2f}") if first else "",
                _num(r.get("energy_per_sample_j"), "{:.3f}") if first else "",
                _num(r.get("sm_activity_pct"), "{:.0f}") if first else "",
            )  # fmt: skip
        table.add_section()
    console.print(table)
    for w in doc.get("warnings") or []:
        console.print(Text.assemble(("warning: ", "yellow"), str(w)))
    console.print(Text.assemble(("recommendation: ", "bold"), str(doc["recommendation"])))
    if doc.get("run_id"):
        console.print(Text(f"stored as run {doc['run_id']}", style="dim"))


def render_plan(console: Console, doc: dict[str, Any]) -> None:
    for title, p in (("plan (greedy)", doc["plan"]), ("best by exhaustive search",
                                                       doc["exhaustive"])):  # fmt: skip
        table = Table(
            title=f"{title}: {p['gpus']} GPU(s), {p['normalized_throughput_per_gpu']:.2f}x per GPU",
            title_justify="left",
        )
        for col in ("jobs", "mechanism", "setting", "aggregate", "worst slowdown"):
            table.add_column(col, justify="right" if col in ("aggregate", "worst slowdown")
                             else "left")  # fmt: skip
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
