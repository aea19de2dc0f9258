"""``gpulens report RUN... -o report.html`` (the figures of stored runs in one HTML file) and
``gpulens export RUN --perfetto trace.json`` (a run as a trace)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import typer

from gpulens.cli import common
from gpulens.errors import UsageError

REPORT_HELP = (
    "Write one self-contained HTML file (works offline) with the figures of stored runs: GPU "
    "activity, memory, power and clocks over time with each step's phases beneath, the "
    "step-time distribution, the stall breakdown of `gpulens stalls` runs, loader stages per "
    "worker, and a colocate experiment's alone/together throughputs, slowdown heat map and "
    "fairness. With several runs, a comparison table marks the differences. Every figure "
    "saves as PNG or SVG from its toolbar.\n\n"
    "A RUN is a run id (or unique prefix, name, or 'latest'), a run directory, or a folder of "
    "runs (e.g. the runs of one `gpulens stalls`).\n\n"
    "\b\nExamples:\n"
    "  gpulens report latest\n"
    "  gpulens report 20261124-0812-ab12 20261124-0830-cd34 -o compare.html\n"
    "  gpulens report ~/stalls-runs -o stalls.html\n\n"
    "Needs plotly: pip install 'gpulens[ui]'."
)


def _write_whole(out: Path, text: str) -> Path:
    """Write ``text`` to ``out`` next to its place and rename it: an interrupted write leaves
    no half file."""
    out = out.expanduser()
    if not out.parent.is_dir():
        raise UsageError(f"cannot write {out}: folder {out.parent} does not exist")
    if out.is_dir():
        raise UsageError(
            f"cannot write {out}: it is a folder; give a file name (-o {out}/report.html)"
        )
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as an ordinary file (mkstemp makes it private)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def _records(refs: list[str]):
    from gpulens.record.reader import scan_records
    from gpulens.record.schema import RUN_FILE
    from gpulens.store.queries import find_run

    records, skipped = [], []
    for ref in refs:
        path = Path(ref).expanduser()
        if path.is_dir() and not (path / RUN_FILE).is_file():
            found, damaged = scan_records(path)
            if not found:
                if damaged:  # every record in the folder is damaged: say which and how
                    raise damaged[0].error()
                raise UsageError(f"{ref} holds no gpulens runs: give a run id or a run directory")
            for bad in damaged:  # one damaged record does not stop the report of the others
                common.warn("warning: skipped: ", bad.message())
                skipped.append(str(bad.dir))
            records += found
        else:
            records.append(find_run(ref))
    # a run named twice (its id and the folder holding it) is shown once, where first named
    unique: dict[Path, object] = {}
    for r in records:
        unique.setdefault(r.dir.resolve(), r)
    return list(unique.values()), skipped


def report(
    runs: list[str] = typer.Argument(..., help="Runs to show (ids, prefixes, names, folders)."),
    out: Path = typer.Option(
        Path("report.html"), "--out", "-o", help="The HTML file to write (*.html)."
    ),
    title: str = typer.Option(None, "--title", help="The page title [default: from the runs]."),
    json_out: bool = typer.Option(False, "--json", help=common.JSON_HELP),
) -> None:
    if out.suffix.lower() not in (".html", ".htm") and not out.expanduser().is_dir():
        # a PNG would need kaleido, no dependency of gpulens; each figure saves as PNG from
        # its toolbar in the page
        raise UsageError(
            f"cannot write {out}: the report is one HTML file, its name must end in .html "
            f"(-o {out.with_suffix('.html')}); each figure saves as PNG from its toolbar"
        )
    try:
        import plotly  # noqa: F401
    except ImportError:
        raise UsageError(
            "gpulens report needs plotly, which this install lacks: pip install 'gpulens[ui]' "
            "(a GPU node can record without it; make the report where plotly is installed)"
        ) from None
    from gpulens.report.document import build_report
    from gpulens.report.html import render_html

    records, skipped = _records(runs)
    sections = build_report(records)
    if title is None:
        names = [str(r.meta.get("name") or r.run_id) for r in records]
        title = "gpulens: " + (", ".join(names[:3]) + (" ..." if len(names) > 3 else ""))
    page = render_html(sections, title)
    out = _write_whole(out, page)
    n_figures = sum(len(s.figures) for s in sections)
    if json_out:
        common.emit_json(
            {"report": str(out), "runs": [r.run_id for r in records], "figures": n_figures,
             "bytes": out.stat().st_size, "skipped": skipped}
        )  # fmt: skip
        return
    common.out.print(
        f"wrote {out} ({n_figures} figure{'s' * (n_figures != 1)}, {len(records)} "
        f"run{'s' * (len(records) != 1)}, "
        f"{out.stat().st_size / 1e6:.1f} MB): open it in a browser"
    )


EXPORT_HELP = (
    "Write a stored run as a Chrome/Perfetto trace: each step with its data wait, copy and "
    "compute, each loader worker's read, decode, augment and collate, and the GPU and host "
    "counters (activity, memory, power, clocks, PCIe, CPU, disk) on one time line. Open it at "
    "https://ui.perfetto.dev or chrome://tracing.\n\n"
    "\b\nExample:\n"
    "  gpulens export latest --perfetto trace.json\n\n"
    "Other formats (a copy, CSV, Parquet, JSON): gpulens runs export."
)


def export(
    run: str = typer.Argument(..., help="Run id, unique prefix, name, 'latest' or a run dir."),
    perfetto: Path = typer.Option(
        ..., "--perfetto", help="The trace file to write (JSON, trace-event format)."
    ),
    torch_profiler: Path = typer.Option(
        None,
        "--torch-profiler",
        help="A PyTorch profiler Chrome trace to merge in [default: the run's own, from "
        "gpulens run --torch-profiler N].",
    ),
    json_out: bool = typer.Option(False, "--json", help=common.JSON_HELP),
) -> None:
    import json

    from gpulens.report.perfetto import perfetto_trace
    from gpulens.store.queries import find_run

    record = find_run(run)
    extra = None
    if torch_profiler is not None:
        try:
            extra = json.loads(Path(torch_profiler).expanduser().read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(
                f"cannot read the profiler trace {torch_profiler}: {exc}; give the JSON file "
                "that torch.profiler's export_chrome_trace() wrote"
            ) from None
        if not isinstance(extra, dict) or not isinstance(extra.get("traceEvents"), list):
            raise UsageError(f"{torch_profiler} is no Chrome trace (no traceEvents list)")
    trace = perfetto_trace(record, extra)
    out = _write_whole(perfetto, json.dumps(trace, separators=(",", ":")))
    n = len(trace["traceEvents"])
    if json_out:
        aligned = trace["metadata"]["torch_profiler_aligned_by"]
        common.emit_json({"run_id": record.run_id, "perfetto": str(out), "events": n,
                          "torch_profiler_aligned_by": aligned})  # fmt: skip
        return
    common.out.print(f"wrote {out} ({n:,} events): open it at https://ui.perfetto.dev")


def register(app: typer.Typer) -> None:
    app.command(help=REPORT_HELP, short_help="One HTML file with the figures of stored runs.")(
        report
    )
    app.command(help=EXPORT_HELP, short_help="A run as a Perfetto/Chrome trace.")(export)
