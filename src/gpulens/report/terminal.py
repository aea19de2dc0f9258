"""Terminal rendering of summaries (rich). The only place besides cli/web that prints.

Text that comes from users or data (names, paths, commands, GPU names, notes) is escaped or
wrapped in ``Text``: it is never read as rich markup.
"""

from __future__ import annotations

import re
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from gpulens.run.advice import advise

# Tables without side borders and with collapsed padding: they must read in 80 columns.
COMPACT = {"box": box.SIMPLE_HEAD, "pad_edge": False, "collapse_padding": True, "show_edge": False}


def _fmt(value: Any, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "[dim]n/a[/dim]"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{unit}"
    return escape(f"{value}{unit}")


def _ms(value_s: float | None) -> str:
    return "[dim]n/a[/dim]" if value_s is None else f"{1000 * value_s:,.2f} ms"


# The last line of every run summary: where to go from here.
COMPARE_TIP = "compare runs with `gpulens runs compare RUN RUN`; list them with `gpulens runs list`"


def next_steps(summary: dict[str, Any]) -> list[str]:
    """What to look at next: the run's advice (``gpulens.run.advice``, most telling first) and
    how to compare runs. Rendering only: the bars are in ``advise``."""
    return [a.text for a in advise(summary)] + [COMPARE_TIP]


def _ranks_text(summary: dict) -> str:
    """The straggler check over a data-parallel run's ranks, in one line."""
    ranks = f"{summary.get('ranks_reported') or len(summary['ranks'])} of {summary['world_size']}"
    found = summary.get("stragglers") or []
    if not found:
        pct = summary.get("straggler_threshold_pct")
        over = f" (none {pct:g}% of the median step above the median rank)" if pct else ""
        return f"{ranks}, no straggler{over}"
    parts = [
        f"rank {s['rank']} ({'step' if s['phase'] == 'step' else 'data wait'} "
        f"{_ms(s['mean_s'])}, +{s['above_median_pct']:.0f}% of the median step)"
        for s in found
    ]
    return f"{ranks}; straggler: " + ", ".join(parts)


def render_train_summary(
    console: Console,
    run_id: str,
    record_dir,
    summary: dict[str, Any],
    more_tips: tuple[str, ...] = (),
) -> None:
    """The summary ``gpulens run`` and ``gpulens demo`` print; ``more_tips`` go last in "Next"."""
    title = (
        f"{summary['workload']} on {summary['device']} · {summary['precision']} · "
        f"batch {summary['batch_size']}"
    )
    if (summary.get("processes") or 1) > 1:
        title += f" per process ({summary['global_batch_size']} per step in all, DDP)"
    title = escape(title)
    table = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    tput = summary.get("throughput_samples_per_s")
    table.add_row("throughput", f"{_fmt(tput)} samples/s{_ci_text(summary)}")
    table.add_row(
        "steps",
        escape(
            f"{summary['measured_steps']} measured after {summary['warmup_steps']} warm-up "
            f"(stopped by {summary['stop_reason']})"
        ),
    )
    phases = summary.get("phases_s") or {}
    step = phases.get("step")
    for key, label in (("data_wait", "data wait"), ("h2d", "host→device"), ("compute", "compute")):
        value = phases.get(key)
        share = f"  ({100 * value / step:.0f}% of step)" if value is not None and step else ""
        table.add_row(f"  {label}", _ms(value) + share)
    table.add_row("  step", _ms(step))
    if summary.get("skipped_samples"):
        first = ", ".join(summary.get("skipped_files") or [])
        table.add_row(
            "skipped samples",
            Text(
                f"{summary['skipped_samples']} bad samples replaced "
                f"({summary.get('skipped_files_total')} files; first: {first})"
            ),
        )
    if (summary.get("world_size") or 1) > 1 and summary.get("ranks"):
        table.add_row("ranks", escape(_ranks_text(summary)))
    gpu = summary.get("gpu")
    if gpu:
        table.add_row("GPU", Text(str(gpu.get("name") or "")))
        table.add_row("  utilization", _fmt(gpu.get("gpu_util_pct"), "%"))
        if gpu.get("sm_activity_pct") is not None:
            table.add_row(
                "  SM / tensor activity",
                f"{_fmt(gpu.get('sm_activity_pct'), '%')} / "
                f"{_fmt(gpu.get('tensor_activity_pct'), '%')}",
            )
        peak = gpu.get("peak_mem_allocated_bytes")
        table.add_row("  peak memory", _fmt(peak / 2**30 if peak else None, " GiB", 2))
        table.add_row("  power", _fmt(gpu.get("power_mean_w"), " W"))
        table.add_row("  energy / sample", _fmt(gpu.get("energy_per_sample_j"), " J", 3))
        mfu = summary.get("mfu")
        table.add_row("  MFU", _fmt(100 * mfu if mfu is not None else None, "%"))
    else:  # shown as n/a, as the README says of what a machine cannot measure, not left out
        table.add_row("GPU", "[dim]n/a[/dim] (no GPU measured: utilization, memory, power, MFU)")
    host = summary.get("host") or {}
    table.add_row("CPU utilization", _fmt(host.get("cpu_util_pct"), "% of all cores"))
    table.add_row("  this run's processes", _fmt(host.get("proc_tree_cpu_pct"), "% of one core"))
    _monitor_rows(table, summary)
    console.print(table)
    console.print(Text(f"run {run_id} · record {record_dir}", style="dim"), soft_wrap=True)
    console.print("[bold]Next:[/bold]")
    for tip in [*next_steps(summary), *more_tips]:
        for n, line in enumerate(wrap_keeping_commands(tip, console.width - 4)):
            console.print(Text(("  • " if n == 0 else "    ") + line), soft_wrap=True)


def wrap_keeping_commands(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters, broken only between words and never
    inside a `command` (a command split over two lines, pasted back, runs something else); a
    command longer than a line gets a line of its own."""
    words = re.findall(r"`[^`]*`[^\s`]*|\S+", text)
    lines: list[str] = []
    for word in words:
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines or [""]


def _ci_text(summary: dict[str, Any]) -> str:
    """`` ± 2.9% (95% CI 1,180.2–1,250.3)``: the half-width, and the interval where known."""
    ci = summary.get("throughput_ci95_pct")
    if ci is None:
        return " (too few steps for a CI)"
    text = f" ± {ci:.1f}% (95% CI"
    bounds = summary.get("throughput_ci95_samples_per_s")
    if isinstance(bounds, (list, tuple)) and len(bounds) == 2 and None not in bounds:
        text += f" {bounds[0]:,.1f}–{bounds[1]:,.1f}"
    return text + ")"


def sampler_cpu_pct(summary: dict[str, Any]) -> float | None:
    """The sampler's CPU time as a share of one core (``monitor_overhead_pct`` in old runs)."""
    value = summary.get("sampler_cpu_pct_of_core")
    return summary.get("monitor_overhead_pct") if value is None else value


def _monitor_rows(table: Table, summary: dict[str, Any]) -> None:
    """What measuring cost: the sampler process's CPU and gpulens's time on the training
    thread. Neither is a slowdown of the training (none was measured here)."""
    table.add_row("sampler CPU (share of one core)", _fmt(sampler_cpu_pct(summary), "%", 2))
    per_step = summary.get("tracking_us_per_step")
    if per_step is not None or "tracking_us_per_step" in summary:
        table.add_row("gpulens time per step", _fmt(per_step, " µs", 1))


def render_command_summary(console: Console, result) -> None:
    s = result.summary
    ended = (
        "stopped at --duration"
        if s.get("stop_reason") == "duration"
        else f"exit code {result.returncode}"
    )
    console.print(
        f"[bold]{escape(str(result.status))}[/bold] · {ended} · "
        f"{s.get('wall_s') or 0:.1f} s · run {escape(str(result.run_id))}"
    )
    if s.get("stop_reason") == "duration" and s.get("throughput_samples_per_s") is None:
        console.print(
            "no steps measured: --duration ended the command before any step past warm-up "
            "(give a longer --duration)"
        )
    if s.get("steps_total") == 0:  # its loader was timed, but no optimizer step came
        console.print(
            "no steps seen: the script iterated a DataLoader but never called a torch.optim "
            "optimizer's step() (wrap its loop in gpulens.track() to time it)"
        )
    if s.get("steps_total"):  # every step the script made, the warm-up ones said
        warmup = s.get("warmup_steps")
        console.print(
            f"steps: {s['steps_total']}"
            + (f", {s.get('measured_steps')} measured after {warmup} warm-up" if warmup else "")
            + (f" ({s['warmup_note']})" if s.get("warmup_note") else "")
        )
    if s.get("throughput_samples_per_s") is not None:
        ci_text = _ci_text(s) if s.get("throughput_ci95_pct") is not None else ""
        console.print(f"throughput {s['throughput_samples_per_s']:,.1f} samples/s{ci_text}")
        phases = s.get("phases_s") or {}
        console.print(
            f"per step: data wait {_ms(phases.get('data_wait'))}, "
            f"compute {_ms(phases.get('compute'))}, step {_ms(phases.get('step'))}"
        )
    for g in s.get("gpus") or []:
        console.print(
            f"GPU {g['gpu_index']}: utilization {_fmt(g.get('gpu_util_pct'), '%')}, "
            f"power {_fmt(g.get('power_mean_w'), ' W')}, energy {_fmt(g.get('energy_j'), ' J')}"
        )
    host = s.get("host") or {}
    console.print(f"CPU: {_fmt(host.get('proc_tree_cpu_pct'), '% of one core')} for the command")
    sampler = sampler_cpu_pct(s)
    if sampler is not None:
        console.print(f"sampler CPU (share of one core): {sampler:.2f}%")
    if s.get("tracking_us_per_step") is not None:
        console.print(f"gpulens time per step: {s['tracking_us_per_step']:,.1f} µs")
    console.print(Text(f"record {result.record_dir}", style="dim"), soft_wrap=True)


def render_checks(console: Console, checks) -> None:
    table = Table(title="gpulens doctor", title_justify="left")
    table.add_column("check")
    table.add_column("status")
    table.add_column("value / how to enable")
    for c in checks:
        mark = "[green]ok[/green]" if c.ok else "[yellow]missing[/yellow]"
        detail = str(c.value) if c.ok or not c.how_to_enable else f"{c.value} — {c.how_to_enable}"
        table.add_row(Text(str(c.name)), mark, Text(detail))
    console.print(table)


def render_extras(console: Console, extras) -> None:
    table = Table(title="optional extras", title_justify="left")
    table.add_column("extra")
    table.add_column("status")
    table.add_column("for")
    table.add_column("install", no_wrap=True)  # a command to copy whole
    for e in extras:
        mark = "[green]installed[/green]" if e.installed else "[yellow]missing[/yellow]"
        table.add_row(Text(e.name), mark, Text(e.used_for), Text(e.install_command or ""))
    console.print(table)


_STALL_COLORS = {
    "compute": "green",
    "prep_stall": "yellow",
    "fetch_stall": "red",
    "interconnect_stall": "magenta",
    "network_stall": "blue",
}


def render_stalls(console: Console, doc: dict[str, Any], width: int = 60) -> None:
    """The stall breakdown: a stacked bar with 95% CIs, the runs, what-if and advice."""
    shares = doc["breakdown_pct"]
    cis = doc["breakdown_ci95_pp"]
    bar = ""
    for name, color in _STALL_COLORS.items():
        value = shares.get(name)
        if value:
            bar += f"[{color}]" + "█" * max(1, round(width * value / 100)) + f"[/{color}]"
    on = f" on {escape(str(doc['device']))}" if doc.get("device") else ""
    what = escape(str(doc["workload"]))  # a command line may hold [brackets]
    console.print(f"[bold]Where the time of {what}{on} goes[/bold]", highlight=False)
    console.print(bar)
    table = Table(box=None, show_header=True, pad_edge=False)
    table.add_column("component")
    table.add_column("share", justify="right")
    table.add_column("95% CI", justify="right")
    for name, color in _STALL_COLORS.items():
        value = shares.get(name)
        ci = cis.get(name)
        table.add_row(
            f"[{color}]■[/{color}] {name.replace('_', ' ')}",
            "[dim]not measured[/dim]" if value is None else f"{value:.1f}%",
            "" if ci is None else f"±{ci:.1f} pp",
        )
    console.print(table)
    runs = Table(title="runs", title_justify="left", box=None, pad_edge=False)
    runs.add_column("run")
    runs.add_column("samples/s", justify="right")
    runs.add_column("95% CI", justify="right")
    runs.add_column("run id")
    paired = doc.get("fetch_paired") or {}
    paired_runs = {r["run_id"]: r for r in paired.get("runs") or []}
    for kind, run_id in doc["runs"].items():
        if run_id is None:
            continue
        tput = doc["throughput_samples_per_s"].get(kind)
        ci = doc["throughput_ci95_pct"].get(kind)
        if run_id in paired_runs:
            kind = f"{kind} (half cold)"
            tput = paired_runs[run_id]["samples_per_s"]
            ci = paired_runs[run_id]["samples_per_s_ci95_pct"]
        runs.add_row(Text(kind), _fmt(tput), "" if ci is None else f"±{ci:.1f}%", Text(run_id))
    console.print(runs)
    if paired:
        last = paired["runs"][-1]
        extra, read = last["extra_ms_per_cold_sample"], last["extra_read_ms_per_cold_sample"]
        fetch, fetch_ci = paired["fetch_ms_per_sample"], paired["fetch_ci95_ms"]
        workers = paired["workers"]
        console.print(
            f"paired cold run: a cold sample costs a loader worker {extra:.2f} ms more "
            f"({read:.2f} ms of it reading); over {workers} worker{'s' * (workers != 1)} the fetch "
            f"stall is {fetch:.3f} ± {fetch_ci:.3f} ms per sample. Check: the paired run went at "
            f"{last['samples_per_s']:,.0f} samples/s, the breakdown implies "
            f"{last['expected_samples_per_s']:,.0f}"
        )
    est = doc.get("single_run_estimate_pct") or {}
    if est.get("data_wait") is not None:
        stages = est.get("prep_stages") or {}
        stage_text = ", ".join(f"{k} {v:.0f}%" for k, v in stages.items() if v is not None)
        console.print(
            Text(
                f"single run (cached): the loop waits for data {est['data_wait']:.1f}% of the "
                "time" + (f"; prep time goes to {stage_text}" if stage_text else "")
            )
        )
        if est.get("explanation"):
            console.print(Text(f"  {est['explanation']}"))
    timers = est.get("read_stall_from_timers") or {}
    if timers.get("fetch_read_pct") is not None:
        console.print(
            f"the workers' read timers: cold reads add {timers['fetch_read_pct']:.1f}% "
            f"± {timers['ci95_pp']:.1f} pp to the cold time ("
            f"{timers['read_ms_per_sample_cold']:.2f} vs {timers['read_ms_per_sample_cached']:.2f}"
            " ms per sample read)"
        )
    wi = doc.get("what_if") or {}
    for key, label, unit in (
        ("workers", "workers", ""),
        ("page_cache_pct", "% of dataset in page cache", "%"),
        ("storage", "storage", ""),
    ):
        if wi.get(key):
            values = ", ".join(f"{k}{unit}: {v:,.0f}" for k, v in wi[key].items())
            console.print(Text(f"what if, {label} → samples/s: {values}"))
    if doc.get("recommendations"):
        console.print("[bold]Recommendations[/bold] (by predicted gain)")
        for r in doc["recommendations"]:
            console.print(
                Text(
                    f"  • {r['action']}: {r['predicted_samples_per_s']:,.0f} samples/s "
                    f"({r['predicted_gain_pct']:+.0f}%)"
                )
            )
    for note in doc.get("notes") or []:
        console.print(Text(f"note: {note}", style="dim"))
    if doc.get("wall_s") is not None:
        console.print(f"[dim]the breakdown took {doc['wall_s']:.0f} s[/dim]")
