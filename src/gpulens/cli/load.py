"""``gpulens load``: an open-loop load generator for KServe v2 (and OpenAI-compatible) servers."""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import replace
from typing import Any

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from gpulens.cli import common
from gpulens.cli.common import JSON_HELP
from gpulens.errors import UsageError
from gpulens.paths import runs_dir

LOAD_HELP = (
    "Send requests to an inference server on one schedule for all tenants (an open loop: each "
    "request leaves at its time whatever the server does) and report, per tenant, the achieved "
    "vs intended rate, latency p50/p90/p99/p99.9 from each request's scheduled time, SLO "
    "attainment, goodput and errors; the server's queue vs compute split from its /metrics "
    "(Triton's metric names); and the generator's own lateness, so you know when the "
    "generator, not the server, was the limit.\n\n"
    "A TENANT is MODEL:rate=R[:slo_ms=S][:arrival=poisson|constant][:batch=B] (rate in "
    "requests/s; commas between the options work too, as in MODEL:rate=R,slo_ms=S). "
    "Requests are KServe v2 infer requests built from GET /v2/models/MODEL "
    "(any KServe v2 server, Triton included); --openai MODEL sends that tenant's requests to "
    "an OpenAI-compatible /v1/completions endpoint, streamed, and reports time to first token "
    "and time per output token.\n\n"
    "\b\nExamples:\n"
    "  gpulens load --url http://127.0.0.1:8000 --tenant resnet50:rate=100:slo_ms=50 "
    "--duration 30\n"
    "  gpulens load --url http://127.0.0.1:8000 --tenant resnet50:rate=50:slo_ms=50 "
    "--tenant bert:rate=20:slo_ms=100 --find-max resnet50\n"
    "  gpulens load --url http://127.0.0.1:8000 --tenant resnet50:rate=10:slo_ms=50 "
    "--sweep resnet50:rates=10,20,40\n"
    "  gpulens load --url http://127.0.0.1:8000 --tenant resnet50:slo_ms=50 "
    "--sweep resnet50:concurrency=1,4,16,64\n"
    "  gpulens load --url http://127.0.0.1:8000 --tenant llm:rate=2 --openai llm "
    "--prompt-tokens 256 --max-tokens 128"
)


def register(app: typer.Typer) -> None:
    app.command(
        help=LOAD_HELP,
        short_help="Open-loop load on an inference server: latency, SLO attainment, max rate.",
    )(load)


def build_config(
    url: str | None,
    tenants: list[str] | None,
    openai: list[str] | None,
    **options: Any,
):
    """The LoadConfig of a command line (usage errors name the fix)."""
    from gpulens.serve.load_config import TENANT_FORMAT, LoadConfig, TenantSpec

    if not url:
        raise UsageError("give the server's base URL, e.g. --url http://127.0.0.1:8000")
    if not tenants:
        raise UsageError(f"give at least one --tenant {TENANT_FORMAT}")
    specs = [TenantSpec.parse(t) for t in tenants]
    names = {s.model for s in specs}
    for model in openai or []:
        if model not in names:
            raise UsageError(f"--openai {model}: add --tenant {model}:rate=R for it")
    specs = [
        TenantSpec(
            s.model, s.rate_rps, s.slo_ms, s.arrival, s.batch, openai=s.model in (openai or [])
        )
        for s in specs
    ]
    if options.get("scenario") == "server":  # LoadGen's server scenario: Poisson arrivals
        specs = [
            TenantSpec(s.model, s.rate_rps, s.slo_ms, "poisson", s.batch, s.openai) for s in specs
        ]
    return LoadConfig(url=url, tenants=tuple(specs), **options)


def render(doc: dict) -> None:
    out = common.out
    table = Table(
        title=f"gpulens load · {doc['url']} · {doc['duration_s']:g} s measured · latency in ms",
        box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True,
        show_edge=False,
    )  # fmt: skip

    def num(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    def ms(v):  # three significant figures, never in exponent form
        if v is None:
            return "-"
        return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:,.0f}"

    def rate(v):  # requests/s: a decimal below 100, whole numbers with commas above
        return num(v, "{:.1f}" if v is None or v < 100 else "{:,.0f}")

    rows = []
    for t in doc["tenants"]:
        lat = t["latency_ms"]
        rows.append((
            t["model"], rate(t["intended_rate_rps"]), rate(t["achieved_rate_rps"]),
            ms(lat["p50"]), ms(lat["p90"]), ms(lat["p99"]), ms(lat["p999"]),
            num(t["slo_ms"], "{:,.0f}" if (t["slo_ms"] or 0) >= 100 else "{:g}"),
            num(t["slo_attainment"] and 100 * t["slo_attainment"], "{:.1f}%"),
            rate(t["goodput_rps"]), f"{t['errors']['count']:,}",
        ))  # fmt: skip
    # short headers: the table must stay readable in an 80-column terminal; a number is never
    # cut short (it once read '2000…' and '12,…'): only a long tenant name gives way
    heads = ("tenant", "want/s", "got/s", "p50", "p90", "p99", "p99.9", "SLO", "in SLO",
             "good/s", "err")  # fmt: skip
    widths = [max([len(col)] + [len(r[k]) for r in rows]) for k, col in enumerate(heads)]
    numbers = sum(widths[1:])
    gap = 2 if 9 + numbers + 2 * (len(heads) - 1) <= out.width else 1  # else one space apart
    if gap == 1:
        table.padding = (0, 0)
    widths[0] = min(widths[0], max(9, out.width - numbers - gap * (len(heads) - 1)))
    for k, col in enumerate(heads):
        table.add_column(col, justify="left" if k == 0 else "right", no_wrap=True,
                         min_width=widths[k], max_width=widths[k] if k == 0 else None)  # fmt: skip
    for row in rows:
        table.add_row(*row)
    out.print(table)

    def say(text: str) -> None:
        out.print(text, highlight=False, soft_wrap=True)

    def f2(v) -> str:
        return num(v, "{:.2f}")

    streamed = [t for t in doc["tenants"] if t.get("ttft_ms")]
    if streamed:
        out.print(_token_table(streamed, ms))
    for t in doc["tenants"]:
        if t["errors"]["count"]:
            say(f"{t['model']}: errors {t['errors']['by_kind']}")
    server = doc.get("server")
    if server is None:
        reason = doc.get("server_reason")
        out.print(Text(f"server split: not available ({reason})", style="dim"), soft_wrap=True)
    else:
        for model, s in server["models"].items():
            if "reason" in s:
                out.print(Text(f"server {model}: {s['reason']}", style="dim"))
                continue
            say(
                f"server {model}: {s['requests']} requests, queue {f2(s.get('mean_queue_ms'))} "
                f"ms, compute {f2(s.get('mean_compute_ms'))} ms per request, mean batch "
                f"{f2(s.get('mean_batch_size'))}"
            )
    late = doc["loadgen_lateness_ms"]
    if (doc.get("scenario") or {}).get("scenario") != "offline":  # offline: all due at once
        say(f"generator lateness: p50 {num(late['p50'], '{:.3f}')} ms, p99 {f2(late['p99'])} ms")
    for note in doc["generator_notes"]:
        common.warn("warning: ", note)
    if doc.get("scenario"):
        say(_scenario_line(doc["scenario"]))
    if doc.get("cost_per_1k_requests_usd") is not None:
        src = doc.get("price_source")
        where = (
            f" (one of {src['gpus']} GPUs of {src['provider']} {src['instance']}, "
            f"{src['pricing']} {src['instance_usd_per_h']:g} USD/h, price of {src['price_date']})"
            if src
            else ""
        )
        out.print(
            Text(
                f"cost: {doc['cost_per_1k_requests_usd']:.4f} USD per 1k requests within SLO{where}"
            ),
            soft_wrap=True,
        )
    if doc.get("find_max"):
        fm = doc["find_max"]
        out.print(
            f"find-max {fm['tenant']}: {num(fm['max_rate_rps'], '{:.2f}')} requests/s within "
            f"{fm['slo_ms']:g} ms ({len(fm['trials'])} trials, converged: {fm['converged']})",
            highlight=False,
        )
    for row in doc.get("sweep") or []:
        if "concurrency" in row:
            level = f"{row['concurrency']} outstanding"
            p99 = (row.get("latency_ms") or {}).get("p99")
        else:
            level, p99 = f"{row['rate_rps']:g}/s", row["p99_ms"]
        out.print(
            f"sweep {level}: achieved {row['achieved_rate_rps']:.1f}/s, p99 "
            f"{num(p99, '{:.2f}')} ms, within SLO {num(row['slo_attainment'], '{:.4f}')}",
            highlight=False,
        )
    if doc.get("record_dir"):
        out.print(Text(f"record: {doc['record_dir']}", style="dim"))


def _scenario_line(sc: dict) -> str:
    """The figure LoadGen reports for the scenario, in words."""
    name, metric, value = sc.get("scenario"), sc.get("metric"), sc.get("value")
    if metric == "p90_latency_ms":
        return f"scenario {name}: p90 latency " + ("-" if value is None else f"{value:.2f} ms")
    if metric == "p99_latency_within_slo":
        return f"scenario {name}: " + (
            "valid, every tenant's p99 latency is within its SLO"
            if sc.get("valid")
            else "not valid, a tenant's p99 latency is beyond its SLO"
        )
    if metric == "samples_per_s":
        if value is None:
            return f"scenario {name}: no samples/s, no request succeeded"
        return f"scenario {name}: {value:,.1f} samples/s ({sc.get('samples', 0):,} samples)"
    return f"scenario {name}: {metric} {value}"


def _token_table(tenants: list[dict], ms) -> Table:
    """Streamed (OpenAI) tenants: request latency beside time to first token and per output
    token, p50 and p99 in ms."""
    table = Table(
        title="streamed tenants · ms", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False,
        collapse_padding=True, show_edge=False,
    )  # fmt: skip
    for col in ("tenant", "lat p50", "lat p99", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"):
        table.add_column(col, justify="left" if col == "tenant" else "right", no_wrap=True,
                         min_width=9 if col == "tenant" else None)  # fmt: skip
    for t in tenants:
        lat, ttft, tpot = t["latency_ms"], t["ttft_ms"], t.get("tpot_ms") or {}
        table.add_row(t["model"], ms(lat["p50"]), ms(lat["p99"]), ms(ttft["p50"]),
                      ms(ttft["p99"]), ms(tpot.get("p50")), ms(tpot.get("p99")))  # fmt: skip
    return table


def summary_of(doc: dict) -> dict:
    """The run record's summary: the document's numbers, tenants keyed by model."""
    return {**doc, "tenants": {t["model"]: t for t in doc["tenants"]}}


def _input_file(text: str) -> tuple[str, str]:
    model, eq, path = text.partition("=")
    if not eq or not model or not path:
        raise UsageError(f"--input {text!r}: write MODEL=request.json")
    return model, path


def effective_of(requested: dict, config, doc: dict) -> dict:
    """What ran: the requested settings with the HTTP client chosen for ``auto`` and the
    request each tenant sent (path, input bytes, binary or JSON tensors)."""
    from gpulens.serve.loadgen import use_raw_client

    client = "raw" if use_raw_client(config) else "aiohttp"
    return {**requested, "client": client, "requests_sent": doc.get("requests_sent")}


def execute(config, find_max: str | None, sweep: str | None, trial_s: float | None,
            max_trials: int, progress, frames: list | None = None) -> dict:  # fmt: skip
    """The measurement: one run, a find-max search or a sweep; returns the document and adds
    each trial's requests (one row each) to ``frames``."""
    from gpulens.serve import load_search
    from gpulens.serve.load_config import parse_sweep
    from gpulens.serve.load_report import requests_frame
    from gpulens.serve.loadgen import run_load

    def one(cfg, label: str) -> dict:
        progress.phase(label)
        outcome = run_load(cfg, progress=lambda done, total: progress.count(done, total))
        if frames is not None:
            models = [t.model for t in cfg.tenants]
            frames.append(requests_frame(outcome.records, models, trial=len(frames)))
        return outcome.document(cfg)

    if find_max is None and sweep is None:
        return one(config, f"{config.duration_s:g} s of load")
    base = config if trial_s is None else replace(config, duration_s=trial_s)

    def trial(model: str):
        spec = base.tenant(model)
        return lambda rate: one(base.with_tenant(spec.with_rate(rate)), f"{model} at {rate:.2f}/s")

    if find_max is not None:
        spec = base.tenant(find_max)
        budget = max_trials * (base.duration_s + base.warmup_s + base.timeout_s)
        result, doc = load_search.find_max(
            trial(find_max), find_max, spec.rate_rps, spec.slo_ms,
            max_trials=max_trials, budget_s=budget,
        )  # fmt: skip
        if doc is None:  # nothing passed: the slowest trial's numbers
            low = min(r["rate_rps"] for r in result["trials"])
            doc = trial(find_max)(low)
        return {**doc, "find_max": result}
    model, kind, values = parse_sweep(sweep)
    base.tenant(model)
    if kind == "concurrency":
        rows, doc = load_search.sweep_concurrency(
            lambda c: one(replace(base, concurrency=int(c)), f"{int(c)} outstanding"),
            model, tuple(int(v) for v in values),
        )  # fmt: skip
        return {**doc, "sweep": rows}
    rows, doc = load_search.sweep(trial(model), model, values)
    return {**doc, "sweep": rows}


def load(
    url: str = typer.Option(
        None, "--url", help="The server's base URL, e.g. http://127.0.0.1:8000."
    ),
    tenants: list[str] = typer.Option(
        None,
        "--tenant",
        help="MODEL:rate=R[:slo_ms=S][:arrival=poisson|constant][:batch=B] (',' between "
        "options works too); repeat.",
    ),
    duration: float = typer.Option(10.0, "--duration", help="Measured seconds (per trial)."),
    warmup: float = typer.Option(1.0, "--warmup", help="Warm-up seconds before, excluded."),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
    find_max: str = typer.Option(
        None, "--find-max", help="TENANT: search its highest rate within its SLO, others held."
    ),
    sweep: str = typer.Option(
        None,
        "--sweep",
        help="TENANT:rates=10,20,40 (one open-loop trial per rate) or "
        "TENANT:concurrency=1,2,4,8 (one closed-loop trial per level, every tenant).",
    ),
    inputs: list[str] = typer.Option(
        None,
        "--input",
        help="MODEL=request.json: send this KServe v2 infer request body for MODEL instead of "
        "one built from its metadata (for servers whose metadata does not list inputs); "
        "repeat per model.",
    ),
    concurrency: int = typer.Option(
        None,
        "--concurrency",
        help="A closed loop: N requests outstanding per tenant, each sent when one returns "
        "(rates unused) [default: open loop at the tenants' rates].",
    ),
    trial_s: float = typer.Option(
        None, "--trial-s", help="Measured seconds per --find-max/--sweep trial [--duration]."
    ),
    max_trials: int = typer.Option(10, "--max-trials", help="At most this many --find-max trials."),
    scenario: str = typer.Option(
        None, "--scenario", help="MLPerf LoadGen-like: single-stream, server or offline."
    ),
    offline_requests: int = typer.Option(
        None,
        "--offline-requests",
        help="Requests sent at once in --scenario offline [rate x duration].",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the arrival times and the inputs."),
    timeout_s: float = typer.Option(
        10.0, "--timeout-s", help="Per-request timeout (a timeout is an error)."
    ),
    max_connections: int = typer.Option(
        2048, "--max-connections", help="Keep-alive connection pool size."
    ),
    price_per_hour: float = typer.Option(
        None, "--price-per-hour", help="The server's USD per hour: cost per 1k requests within SLO."
    ),
    instance: str = typer.Option(
        None,
        "--instance",
        help="Price the server as one GPU of a catalog instance (PROVIDER:INSTANCE, e.g. "
        "aws:p5.48xlarge; see `gpulens advise`): its on-demand USD per hour over its GPUs.",
    ),
    openai: list[str] = typer.Option(
        None,
        "--openai",
        help="MODEL: drive an OpenAI-compatible /v1/completions (streamed) for it.",
    ),
    prompt_tokens: int = typer.Option(
        128,
        "--prompt-tokens",
        help="Prompt length with --openai, in tokens as the server counts them (probed first).",
    ),
    max_tokens: int = typer.Option(
        64, "--max-tokens", help="Output tokens asked for with --openai."
    ),
    client: str = typer.Option(
        "auto",
        "--client",
        help="HTTP client for KServe requests: raw (gpulens's own, thousands of requests/s, "
        "http:// only), aiohttp, or auto (raw on http://).",
    ),
    name: str = typer.Option(None, "--name", help="A name for the run."),
    store: bool = typer.Option(True, "--store/--no-store", help="Log the run to MLflow."),
) -> None:
    if find_max is not None and sweep is not None:
        raise UsageError("give --find-max or --sweep, not both")
    if trial_s is not None and not (trial_s > 0 and math.isfinite(trial_s)):
        raise UsageError(f"--trial-s must be positive seconds, got {trial_s}")
    if max_trials < 1:
        raise UsageError(f"--max-trials must be 1 or more, got {max_trials}")
    price_source = None
    if instance is not None:
        if price_per_hour is not None:
            raise UsageError("give --price-per-hour or --instance, not both")
        from gpulens.predict.instances import gpu_hour_price

        price_source = gpu_hour_price(instance)
        price_per_hour = price_source["usd_per_gpu_hour"]
    if sweep is not None and concurrency is None and ":concurrency=" in sweep:
        from gpulens.serve.load_config import parse_sweep

        concurrency = int(parse_sweep(sweep)[2][0])  # a closed loop from the first trial on
    config = build_config(
        url, tenants, openai, duration_s=duration, warmup_s=warmup, seed=seed, timeout_s=timeout_s,
        scenario=scenario, price_per_hour_usd=price_per_hour, prompt_tokens=prompt_tokens,
        max_tokens=max_tokens, max_connections=max_connections, offline_requests=offline_requests,
        name=name, client=client, concurrency=concurrency,
        input_files=tuple(_input_file(i) for i in inputs or ()),
    )  # fmt: skip
    # the whole plan is checked before the run's record is opened: a refusal leaves none
    if find_max is not None and config.tenant(find_max).rate_rps is None:
        raise UsageError(f"--find-max {find_max}: give its starting rate, e.g. {find_max}:rate=50")
    if find_max is not None:
        from gpulens.serve.load_search import require_slo

        require_slo(find_max, config.tenant(find_max).slo_ms)
    if sweep is not None:
        from gpulens.serve.load_config import parse_sweep

        config.tenant(parse_sweep(sweep)[0])
    # a search over rates needs the open loop: a closed loop or offline ignores the rate (a
    # concurrency-2 loop once reported "find-max: 10.00 requests/s" while sending 2,590/s)
    closed = "--concurrency" if config.concurrency is not None else None
    if config.scenario in ("single-stream", "offline"):
        closed = f"--scenario {config.scenario}"
    searched = "--find-max" if find_max is not None else "--sweep ...:rates=" if sweep else None
    if closed and searched and not (sweep and ":concurrency=" in sweep):
        raise UsageError(f"{searched} steps the open loop's rate, which {closed} does not use: "
                         f"drop {closed}")  # fmt: skip
    from gpulens.serve.load_inputs import request_from_file

    for model, path in config.input_files:  # a file unread or not a request: no record either
        request_from_file(model, path)
    if importlib.util.find_spec("aiohttp") is None:
        raise UsageError("aiohttp is not installed: pip install 'gpulens[serve]'")
    from gpulens.probes.monitor import ProbeSpec
    from gpulens.run.lifecycle import measured_run

    requested = {**config.as_dict(), "find_max": find_max, "sweep": sweep, "trial_s": trial_s,
                 "instance": instance}  # fmt: skip
    run_name = name or "load-" + "+".join(t.model for t in config.tenants)
    try:
        with measured_run(
            runs_dir(), kind="load", name=run_name, requested_config=requested
        ) as run:
            probes = [ProbeSpec("gpu"), ProbeSpec("host", {"root_pid": os.getpid()})]
            with common.progress("load", unit="requests") as progress, run.monitor(probes, hz=10):
                frames: list = []
                doc = execute(config, find_max, sweep, trial_s, max_trials, progress, frames)
            if price_source is not None:  # where --instance's price came from, and its date
                doc = {**doc, "price_source": price_source}
            if frames:
                import pandas as pd

                from gpulens.record.writer import write_series_frame

                write_series_frame(run.dir, "requests", pd.concat(frames, ignore_index=True))
            run.set_effective(effective_of(requested, config, doc))
            run.set_summary(summary_of(doc))
    except BaseException as exc:  # failed and killed runs reach the store too
        common.store_record(getattr(exc, "gpulens_record_dir", None), store)
        raise
    common.store_record(run.dir, store)
    doc = {**doc, "run_id": run.run_id, "record_dir": str(run.dir)}
    if json_out:
        common.emit_json(doc)
    else:
        render(doc)
