"""The sampler process started by :class:`gpulens.probes.monitor.Monitor`.

Protocol on stdin/stdout, one JSON object per line: it prints ``{"ready": true, "unsupported":
{...}}`` once its probes are open, samples until it reads ``stop`` (or stdin closes because the
parent died, or SIGTERM arrives: the parent-death signal), compacts its series and prints
``{"done": {"samples": n, "cpu_s": s, "wall_s": w}}`` (``wall_s``: how long it sampled).

It ignores SIGINT: a Ctrl-C in the terminal is the parent's to handle, and the parent stops the
sampler; so Ctrl-C never prints a traceback from here. The imports wait until SIGINT is ignored.
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    import argparse
    import contextlib
    import json
    import threading
    import time

    from gpulens.probes.monitor import ProbeSpec, build_probe, probe_unsupported, sample_loop
    from gpulens.record import schema
    from gpulens.record.writer import SeriesWriter
    from gpulens.run.interrupts import set_from_handler

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: set_from_handler(stop))

    ap = argparse.ArgumentParser(prog="gpulens-sampler")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--hz", type=float, required=True)
    ap.add_argument("--specs", required=True)
    ap.add_argument("--metrics", default=None, help="serve /metrics at HOST|PORT")
    args = ap.parse_args(argv)
    probes = [build_probe(ProbeSpec(**s)) for s in json.loads(args.specs)]
    series_dir = f"{args.run_dir}/{schema.SERIES_DIR}"
    series = {p.name: SeriesWriter(f"{series_dir}/{p.name}", p.schema) for p in probes}
    writers = dict(series)
    ready = {"ready": True, "unsupported": probe_unsupported(probes)}
    if args.metrics:
        from gpulens.errors import UsageError
        from gpulens.web.metrics import MetricsEndpoint, start_live_metrics

        try:
            _server, url, series = start_live_metrics(
                MetricsEndpoint.from_arg(args.metrics), args.run_dir, series
            )
            ready["metrics_url"] = url
        except UsageError as exc:
            for s in writers.values():
                s.close(compact=True)
            with contextlib.suppress(BrokenPipeError):
                print(json.dumps({"ready": False, "error": str(exc)}), flush=True)
            return 2
    with contextlib.suppress(BrokenPipeError):
        print(json.dumps(ready), flush=True)

    def watch_stdin():
        with contextlib.suppress(Exception):
            sys.stdin.readline()  # "stop", or "" when the parent died and the pipe closed
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    t0 = time.monotonic()
    samples, cpu_s = sample_loop(probes, series, 1.0 / args.hz, stop.is_set, stop.wait)
    wall_s = time.monotonic() - t0
    for s in writers.values():
        s.close(compact=True)
    for p in probes:
        with contextlib.suppress(Exception):  # closing must not lose the report below
            p.close()
    with contextlib.suppress(BrokenPipeError, OSError, ValueError):  # the parent may be gone
        done = {"samples": samples, "cpu_s": cpu_s, "wall_s": wall_s}
        print(json.dumps({"done": done}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
