"""Issue 16, load-generator capacity: can one `gpulens load` process hold a 5,000 requests/s
Poisson schedule with p99 lateness under 1 ms?

A minimal KServe v2 server (raw asyncio, HTTP/1.1 keep-alive, a canned infer response and the
model's metadata) runs in another process; the load generator (gpulens.serve.loadgen, aiohttp)
sends a Poisson schedule at --rate for --duration seconds after --warmup, one tenant, and we
report its lateness (send − scheduled) p50/p99/max, the achieved vs scheduled rate, and
whether the target held. On a 2-core machine the server takes one core, the generator the other.

    /work/venv/bin/python benchmarks/loadgen_capacity.py --rate 5000 --duration 10
    /work/venv/bin/python benchmarks/loadgen_capacity.py --rate 1000,2000,5000 --json out.json
    /work/venv/bin/python benchmarks/loadgen_capacity.py --client aiohttp --rate 2000,3000

The generator's own CPU (process CPU seconds / wall seconds of the run, the server being in
another process) is in each result: at a modest rate it should be a small share of a core,
or it competes with a CPU server on the same machine. ``--server identity`` drives
``gpulens serve --model identity --device cpu`` instead of the canned server:

    /work/venv/bin/python benchmarks/loadgen_capacity.py --server identity --rate 200,1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

META = json.dumps(
    {
        "name": "tiny",
        "versions": ["1"],
        "platform": "canned",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 1]}],
    }  # fmt: skip
).encode()
INFER = json.dumps(
    {
        "model_name": "tiny",
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 1], "data": [0.5]}],
    }  # fmt: skip
).encode()


def _response(status: str, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


RESP_META = _response("200 OK", META)
RESP_INFER = _response("200 OK", INFER)
RESP_404 = _response("404 Not Found", b'{"error":"not found"}')


class CannedHTTP(asyncio.Protocol):
    """Just enough HTTP/1.1: request line, Content-Length, keep-alive; pipelined requests ok."""

    def connection_made(self, transport):
        self.transport = transport
        self.buf = b""

    def data_received(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length :]
            method, path = head.split(" ", 2)[:2]
            if method == "POST" and path.endswith("/infer"):
                self.transport.write(RESP_INFER)
            elif method == "GET" and path == "/v2/models/tiny":
                self.transport.write(RESP_META)
            else:
                self.transport.write(RESP_404)


def serve(sock: socket.socket) -> None:
    if hasattr(os, "sched_setaffinity") and os.cpu_count() and os.cpu_count() >= 2:
        os.sched_setaffinity(0, {os.cpu_count() - 1})

    async def main():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(CannedHTTP, sock=sock, backlog=4096)
        await server.serve_forever()

    asyncio.run(main())


def serve_identity() -> tuple[subprocess.Popen, str]:
    """``gpulens serve --model identity --device cpu`` on a free port, pinned like the canned
    server (the last core), once it answers."""
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    cmd = [sys.executable, "-m", "gpulens.cli", "serve", "--model", "identity", "--device",
           "cpu", "--port", str(port), "--no-store"]  # fmt: skip
    cores = os.cpu_count() or 1
    pin = None
    if hasattr(os, "sched_setaffinity") and cores >= 2:

        def pin() -> None:
            os.sched_setaffinity(0, {cores - 1})

    proc = subprocess.Popen(cmd, env=env, preexec_fn=pin, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"gpulens serve exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"{url}/v2/models/identity", timeout=1).read()
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise SystemExit("gpulens serve did not answer within 120 s")


def one_rate(
    url: str,
    rate: float,
    duration: float,
    warmup: float,
    seed: int,
    client: str = "auto",
    model: str = "tiny",
    arrival: str = "poisson",
) -> dict:
    from gpulens.serve.load_config import LoadConfig, TenantSpec
    from gpulens.serve.loadgen import run_load

    tenant = TenantSpec(model, rate, arrival=arrival)
    cfg = LoadConfig(url=url, tenants=(tenant,), duration_s=duration,
                     warmup_s=warmup, seed=seed, client=client)  # fmt: skip
    t0 = time.process_time()
    wall0 = time.perf_counter()
    out = run_load(cfg)
    cpu_s, wall_s = time.process_time() - t0, time.perf_counter() - wall0
    doc = out.document(cfg)
    t = doc["tenants"][0]
    late = doc["loadgen_lateness_ms"]
    return {
        "rate_rps": rate,
        "arrival": arrival,
        "scheduled_rate_rps": t["scheduled_rate_rps"],
        "achieved_rate_rps": t["achieved_rate_rps"],
        "achieved_fraction": round(t["achieved_rate_rps"] / t["scheduled_rate_rps"], 4),
        "lateness_ms_p50": late["p50"],
        "lateness_ms_p99": late["p99"],
        "lateness_ms_max": late["max"],
        "latency_ms": t["latency_ms"],
        "errors": t["errors"],
        "generator_cpu_pct_of_core": round(100 * cpu_s / wall_s, 1),
        "generator_cpu_s": round(cpu_s, 3),
        "wall_s": round(wall_s, 3),
        "generator_limited": doc["generator_limited"],
        "target_held": bool(late["p99"] is not None and late["p99"] < 1.0
                            and t["achieved_rate_rps"] >= 0.98 * t["scheduled_rate_rps"]),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="5000", help="requests/s, comma-separated for several")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client", default="auto", help="auto/raw (gpulens's own) or aiohttp")
    parser.add_argument("--arrival", default="poisson", help="poisson or constant")
    parser.add_argument("--server", default="canned",
                        help="canned (a minimal server in this script) or identity "
                             "(gpulens serve --model identity --device cpu)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    if args.server == "identity":
        server, url = serve_identity()
        model = "identity"
    elif args.server == "canned":
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(4096)
        port = sock.getsockname()[1]
        ctx = multiprocessing.get_context("fork")
        server = ctx.Process(target=serve, args=(sock,), daemon=True)
        server.start()
        sock.close()
        url, model = f"http://127.0.0.1:{port}", "tiny"
    else:
        parser.error("--server: canned or identity")
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {0})
    results = []
    try:
        for rate in [float(r) for r in args.rate.split(",")]:
            r = one_rate(url, rate, args.duration, args.warmup, args.seed, args.client, model,
                         args.arrival)  # fmt: skip
            results.append(r)
            verdict = "HELD" if r["target_held"] else "NOT HELD"
            print(
                f"rate {rate:g}/s: achieved {r['achieved_rate_rps']:.0f}/s of "
                f"{r['scheduled_rate_rps']:.0f} scheduled ({100 * r['achieved_fraction']:.1f}%), "
                f"lateness p50 {r['lateness_ms_p50']:.3f} ms p99 {r['lateness_ms_p99']:.3f} ms "
                f"max {r['lateness_ms_max']:.1f} ms, latency p50 {r['latency_ms']['p50']} ms "
                f"p99 {r['latency_ms']['p99']} ms, errors {r['errors']['count']}, generator CPU "
                f"{r['generator_cpu_pct_of_core']}% of a core, generator_limited "
                f"{r['generator_limited']} -> p99 lateness < 1 ms: {verdict}",
                flush=True,
            )
    finally:
        server.terminate()
        if args.server == "identity":
            server.wait(10)
        else:
            server.join(5)
    doc = {"benchmark": "loadgen_capacity", "cpus": os.cpu_count(), "client": args.client,
           "server": args.server, "arrival": args.arrival,
           "python": sys.version.split()[0], "results": results}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
