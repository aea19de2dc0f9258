"""Issue 16, server overhead: `gpulens serve --model identity --device cpu` driven by a lean
closed-loop keep-alive client; requests/s and latency percentiles. With --kserve-python PYTHON
(a venv with the `kserve` package), the same trivial model under KServe's Python model server
is measured in the same run, side by side.

The client is asyncio over raw keep-alive sockets (one pre-encoded v2 JSON request of 16 FP32
values, minimal response parsing) in its own process, CONNECTIONS connections in a closed loop.
"Added latency" is the server's whole round trip for a model that does nothing. On a 2-core
machine client and server share the cores: the figures are a lower bound for the server.

    PYTHONPATH=src python benchmarks/serve_overhead.py --seconds 10 --connections 8
    PYTHONPATH=src python benchmarks/serve_overhead.py --kserve-python /tmp/kserve-venv/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BODY = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16],
                               "data": [float(i) for i in range(16)]}]}).encode()  # fmt: skip

KSERVE_MODEL = """
import sys
from kserve import Model, ModelServer
from kserve.protocol.infer_type import InferRequest, InferResponse, InferOutput

class Identity(Model):
    def __init__(self):
        super().__init__("identity")
        self.ready = True

    async def predict(self, payload, headers=None, response_headers=None):
        x = payload.inputs[0].as_numpy()
        out = InferOutput(name="output", shape=list(x.shape), datatype="FP32")
        out.set_data_from_numpy(x, binary_data=False)
        return InferResponse(model_name=self.name, infer_outputs=[out],
                             response_id=payload.id or "")

ModelServer(http_port=int(sys.argv[1]), grpc_port=int(sys.argv[2]), workers=1,
            enable_grpc=False).start([Identity()])
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/v2/models/identity/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready")


# ------------------------------------------------------------------------------ the client
async def _connection(port: int, request: bytes, until: float, lat: list[float]) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    errors = 0
    while time.perf_counter() < until:
        t0 = time.perf_counter()
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await reader.readexactly(length)
        lat.append(time.perf_counter() - t0)
        if not head.startswith(b"HTTP/1.1 200"):
            errors += 1
    writer.close()
    return errors


def drive(port: int, seconds: float, connections: int, warmup_s: float = 2.0) -> dict:
    request = (
        f"POST /v2/models/identity/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
    ).encode() + BODY

    async def main(span: float) -> tuple[list[float], int]:
        lat: list[float] = []
        until = time.perf_counter() + span
        errs = await asyncio.gather(*(_connection(port, request, until, lat)
                                      for _ in range(connections)))  # fmt: skip
        return lat, sum(errs)

    asyncio.run(main(warmup_s))
    t0 = time.perf_counter()
    lat, errors = asyncio.run(main(seconds))
    wall = time.perf_counter() - t0
    lat.sort()

    def pct(q: float) -> float:
        return round(lat[min(len(lat) - 1, int(q / 100 * len(lat)))] * 1000, 3)

    return {"requests": len(lat), "errors": errors, "requests_per_s": round(len(lat) / wall, 1),
            "latency_ms": {"p50": pct(50), "p90": pct(90), "p99": pct(99)},
            "connections": connections}  # fmt: skip


def client_main(args) -> None:
    print(json.dumps(drive(args.port, args.seconds, args.connections)))


def measure(port: int, seconds: float, connections: int) -> dict:
    """The client in its own process (the server's GIL is not the client's)."""
    cmd = [sys.executable, __file__, "--client", "--port", str(port), "--seconds", str(seconds),
           "--connections", str(connections)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the client failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ the servers
def run_gpulens(args) -> dict:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "GPULENS_HOME": tempfile.mkdtemp()}
    cmd = [sys.executable, "-m", "gpulens.cli", "serve", "--model", "identity", "--device", "cpu",
           "--port", str(port), "--no-store", "--json", *shlex.split(args.serve_args)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        result = {"server": "gpulens serve", "command": " ".join(cmd[2:]),
                  **measure(port, args.seconds, args.connections)}  # fmt: skip
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    doc = json.loads(out) if out.strip() else {}
    m = doc.get("models", {}).get("identity", {})
    result["server_side"] = {k: m.get(k) for k in ("mean_batch_size", "queue_ms", "compute_ms",
                                                   "request_ms")}  # fmt: skip
    return result


def run_kserve(args) -> dict:
    port, grpc = free_port(), free_port()
    script = Path(tempfile.mkdtemp()) / "kserve_identity.py"
    script.write_text(KSERVE_MODEL)
    cmd = [args.kserve_python, str(script), str(port), str(grpc)]
    # its access log goes to a file: a pipe nobody reads would fill and stall the server
    log = open(script.with_suffix(".log"), "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        return {"server": "kserve ModelServer", "command": " ".join(cmd),
                **measure(port, args.seconds, args.connections)}  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--kserve-python", help="Python of a venv with kserve installed.")
    ap.add_argument("--serve-args", default="", help="More `gpulens serve` options, one string.")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help="Also write the JSON here.")
    args = ap.parse_args()
    if args.client:
        client_main(args)
        return
    results = {"cpus": os.cpu_count(), "runs": [run_gpulens(args)]}
    if args.kserve_python:
        results["runs"].append(run_kserve(args))
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
