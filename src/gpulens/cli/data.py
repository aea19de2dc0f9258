"""``gpulens data make``: generate datasets for benchmarks."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.text import Text

from gpulens.cli import common
from gpulens.errors import UsageError

data_app = typer.Typer(
    help="Generate datasets for benchmarks.", no_args_is_help=True, rich_markup_mode=None
)


@data_app.command(
    "make",
    help="Generate JPEGs (ImageFolder layout, ~100 KB each, ImageNet-like size) or a token file "
    "for the language model.",
)
def data_make(
    kind: str = typer.Argument(..., help="images or tokens"),
    out_dir: Path = typer.Option(..., "--out", help="Directory to create."),
    n: int = typer.Option(..., "--n", help="Number of images, or of tokens."),
    vocab_size: int = typer.Option(
        50257, "--vocab-size", help="Tokens only: vocabulary size (gpt2_tiny uses 8192)."
    ),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty --out."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    from gpulens.data.datagen import make_images, make_tokens

    if kind not in ("images", "tokens"):
        raise UsageError(f"unknown data kind '{kind}': use images or tokens")
    if n <= 0:
        raise UsageError(f"--n must be a positive integer, got {n}")
    with common.progress("data make", unit=kind) as progress:

        def on_progress(done: int, total: int) -> None:
            progress.count(done, total, f"making {kind}")

        if kind == "images":
            info = make_images(out_dir, n, force=force, progress=on_progress)
        else:
            info = make_tokens(out_dir, n, vocab_size=vocab_size, force=force, progress=on_progress)
    if json_out:
        common.emit_json(info)
    else:
        count = info["n_tokens"] if kind == "tokens" else info["n"]
        common.out.print(
            Text(
                f"made {count:,} {kind} in {info['path']} "
                f"({info['total_bytes'] / 2**20:,.1f} MiB, {info['elapsed_s']:.1f} s)"
            ),
            soft_wrap=True,
        )
