"""``gpulens ui``: the dashboard over the local run store."""

from __future__ import annotations

import typer

from gpulens.cli import common
from gpulens.errors import UsageError

UI_HELP = (
    "A read-only dashboard over the runs in $GPULENS_HOME: a runs table with filters (kind, "
    "workload, GPU, day, status, role in an experiment, name or id), each run's page with the "
    "figures of `gpulens report` (a running run's page reloads every 5 s), and a compare page "
    "for the runs you tick. Serves until Ctrl-C.\n\n"
    "It listens on 127.0.0.1 only unless told otherwise; another address needs --token (every "
    "URL then carries it; --token auto makes one).\n\n"
    "\b\nExamples:\n"
    "  gpulens ui                         # http://127.0.0.1:8050/\n"
    "  gpulens ui --host 0.0.0.0 --port 9000 --token auto\n\n"
    "Needs plotly: pip install 'gpulens[ui]'."
)


def ui(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8050, "--port", help="Port (0: any free one)."),
    token: str = typer.Option(
        None, "--token", help="Required on every request ('auto' makes one); needed off loopback."
    ),
) -> None:
    try:
        import plotly  # noqa: F401
    except ImportError:
        raise UsageError(
            "gpulens ui needs plotly, which this install lacks: pip install 'gpulens[ui]'"
        ) from None
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be 0-65535 (0: any free one), got {port}")
    from gpulens.web.server import make_server

    server, url = make_server(host, port, token)
    common.err.print(f"gpulens ui: serving {url} (Ctrl-C stops it)", soft_wrap=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:  # the way to stop a server: not an error
        common.err.print("gpulens ui: stopped")
    finally:
        server.server_close()


def register(app: typer.Typer) -> None:
    app.command(help=UI_HELP, short_help="A dashboard over the stored runs (read-only).")(ui)
