"""``gpulens serve``: a KServe v2 inference server with dynamic batching, as a measured run."""

from __future__ import annotations

import typer
from rich.text import Text

from gpulens.cli import common
from gpulens.cli.common import JSON_HELP
from gpulens.paths import runs_dir

SERVE_HELP = (
    "Serve built-in models over the Open Inference Protocol (KServe v2 REST, the HTTP API "
    "Triton serves too) with dynamic batching per model and Prometheus /metrics (Triton's "
    "metric names), as a measured run: GPU and host samples while it serves, and a summary "
    "(requests, batch sizes, queue and compute time) when it ends on Ctrl-C, SIGTERM or "
    "--duration.\n\n"
    "A MODEL is a built-in workload (see `gpulens workloads`), bert-base (BERT-base-sized "
    "encoder, INT64 ids [-1,128]) or identity (FP32 [-1,16], no compute: the server's own "
    "overhead); NAME=MODEL serves it under another name. A language model (gpt: GPT-2 small, "
    "gpt-tiny: 4 layers; or gpt2, gpt2_tiny) is also a generative tenant: OpenAI-compatible "
    "POST /v1/completions (stream: true for server-sent events, byte-level UTF-8 tokens) with "
    "a KV cache and continuous batching of up to --max-batch sequences, and time to first "
    "token, time per output token and tokens/s in /metrics and the run's summary.\n\n"
    "\b\nExamples:\n"
    "  gpulens serve --model resnet50 --model bert-base --max-batch 32 --max-queue-delay-ms 5\n"
    "  gpulens serve --model identity --device cpu --port 8000 --duration 60 --json\n"
    "  curl localhost:8000/v2/models/resnet50\n"
    "  gpulens serve --model gpt --max-batch 16   # then: gpulens load --openai gpt ..."
)


def register(app: typer.Typer) -> None:
    app.command(
        help=SERVE_HELP,
        short_help="Serve models over KServe v2 REST with dynamic batching, as a measured run.",
    )(serve)


def serve(
    model: list[str] = typer.Option(
        None, "--model", "-m", help="A model to serve (repeatable): MODEL or NAME=MODEL."
    ),
    max_batch: int = typer.Option(
        32,
        "--max-batch",
        help="Samples per model execution, and sequences generated together by a language "
        "model; 0 or 1: no batching.",
    ),
    max_queue_delay_ms: float = typer.Option(
        0.0,
        "--max-queue-delay-ms",
        help="How long the oldest request may wait for a fuller batch (0, as Triton: batch what "
        "queued while the model was busy).",
    ),
    instances: int = typer.Option(1, "--instances", help="Copies of each model (one worker each)."),
    device: str = typer.Option(
        "auto", "--device", help="cuda:N, cpu or auto (cuda:0 if there is a GPU, else cpu)."
    ),
    precision: str = typer.Option(
        "auto", "--precision", help="auto (bf16 autocast on a GPU, fp32 on CPU), bf16, fp16, fp32."
    ),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."
    ),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free port)."),
    max_queue: int = typer.Option(
        256, "--max-queue", help="Requests waiting per model; beyond, 503 with Retry-After."
    ),
    max_body_mb: float = typer.Option(
        64.0, "--max-body-mb", help="Largest request body in MiB; beyond, 413."
    ),
    duration: float = typer.Option(
        None, "--duration", help="Serve this many seconds, then stop [default: until Ctrl-C]."
    ),
    sample_hz: float = typer.Option(10.0, "--sample-hz", help="Monitor sampling rate."),
    name: str = typer.Option(None, "--name", help="A name for the run."),
    store: bool = typer.Option(True, "--store/--no-store", help="Log the run to MLflow."),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    from gpulens.serve.config import ModelEntry, ServeConfig
    from gpulens.serve.runner import require_extra, run_serve

    config = ServeConfig(
        models=tuple(ModelEntry.parse(m) for m in model or []),
        max_batch=max_batch,
        max_queue_delay_ms=max_queue_delay_ms,
        instances=instances,
        device=device,
        precision=precision,
        host=host,
        port=port,
        max_queue=max_queue,
        max_body_mb=max_body_mb,
        duration_s=duration,
        sample_hz=sample_hz,
        name=name,
    )
    require_extra()  # before any record: one line naming the extra

    def ready(url: str, effective: dict) -> None:
        names = ", ".join(m["name"] for m in effective["models"])
        common.err.print(
            Text(
                f"serving {names} on {url} ({effective['device']}, {effective['precision']}, "
                f"max batch {effective['max_batch']}); Ctrl-C stops"
            ),  # fmt: skip
            soft_wrap=True,
            highlight=False,
        )

    names = ", ".join(m.workload for m in config.models)
    common.err.print(Text(f"serve: building {names}"), soft_wrap=True, highlight=False)
    try:
        with common.live_store(store):
            outcome = run_serve(config, runs_dir(), on_ready=ready)
    except BaseException as exc:  # failed and killed runs reach the store too
        common.store_record(getattr(exc, "gpulens_record_dir", None), store)
        raise
    common.store_record(outcome.result.record_dir, store)
    doc = outcome.document()
    if json_out:
        common.emit_json(doc)
        return
    _render(doc)


def _render(doc: dict) -> None:
    out = common.out
    out.print(
        Text(
            f"run {doc['run_id']} ({doc['status']}, {doc['stop_reason']}): {doc['requests']} "
            f"requests in {doc['served_s']:.1f} s ({doc['requests_per_s'] or 0:.1f}/s), "
            f"{doc['failures']} failed, {doc['rejected_503']} refused (503)"
        ),  # fmt: skip
        highlight=False,
        soft_wrap=True,  # one line, even piped
    )
    for name, m in doc["models"].items():

        def ms(d: dict) -> str:
            return "-" if d["p50"] is None else f"{d['p50']:.2f}/{d['p99']:.2f}"

        batch = "-" if m["mean_batch_size"] is None else f"{m['mean_batch_size']:.2f}"
        out.print(
            Text(
                f"  {name:<16} {m['requests']:>8} req  batch {batch:>6}  queue p50/p99 "
                f"{ms(m['queue_ms'])} ms  compute {ms(m['compute_ms'])} ms  request "
                f"{ms(m['request_ms'])} ms"
            ),  # fmt: skip
            highlight=False,
            soft_wrap=True,  # one line, even piped
        )
        gen = m.get("generation")
        if gen:
            tps = "-" if gen["tokens_per_s"] is None else f"{gen['tokens_per_s']:.1f}"
            out.print(
                Text(
                    f"  {'':<16} {gen['generated_tokens']:>8} tokens ({tps}/s, "
                    f"{gen['mean_sequences_per_iteration'] or 0:.2f} sequences/iteration)  "
                    f"TTFT p50/p99 {ms(gen['ttft_ms'])} ms  TPOT {ms(gen['tpot_ms'])} ms"
                ),  # fmt: skip
                highlight=False,
                soft_wrap=True,  # one line, even piped
            )
    out.print(Text(f"record: {doc['record_dir']}"), highlight=False, soft_wrap=True)
