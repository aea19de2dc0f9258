"""Issue 16 on a GPU: resnet50 and a BERT-base-sized model served together by `gpulens serve`;
the highest rate per tenant at a 50 ms p99 SLO (`gpulens load --find-max`, the other tenant's
load held), with dynamic batching on (--max-batch 32) and off (--max-batch 1).

Beside it, in the same call, a plain PyTorch reference: each model alone, its forward pass at
batch 1 and at batch 32 in a loop (bf16 autocast, channels_last for resnet50, inference_mode),
so the served rates can be read against what the GPU can do at all.

    python benchmarks/serve_gpu.py --out $OUT/serve_gpu.json        # about 6 minutes
    python benchmarks/serve_gpu.py --trial-s 3 --max-trials 6       # shorter

The serve extra must be installed (on a machine without network, from wheels in .whl/:
`pip install --no-index --find-links .whl starlette uvicorn aiohttp`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("resnet50", "bert-base")
SLO_MS = 50.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpulens(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpulens.cli", *args]


def env() -> dict[str, str]:
    # keeps the caller's PYTHONPATH: the serve extra may travel as wheels unpacked beside it
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def wait_ready(
    url: str, proc: subprocess.Popen, timeout_s: float = 300.0, path: str = "/v2/health/ready"
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}{path}", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    err = ""
    if proc.poll() is not None and proc.stderr is not None:
        err = ": " + proc.stderr.read()[-800:].strip()
    raise RuntimeError(f"{url} did not become ready (exit {proc.poll()}){err}")


def plain_reference(device: str, seconds: float = 3.0) -> list[dict]:
    """Each model's forward pass alone in a plain loop: samples/s at batch 1 and 32."""
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    from gpulens.serve.models import get_serve_model

    rows = []
    for name in MODELS:
        spec = get_serve_model(name)
        model = spec.build().eval().to(device)
        image = len(spec.inputs[0].shape) == 3 and device.startswith("cuda")
        if image:
            model = model.to(memory_format=torch.channels_last)
        for batch in (1, 32):
            shape = (batch, *spec.inputs[0].shape)
            if spec.inputs[0].datatype == "INT64":
                x = torch.randint(0, spec.inputs[0].max_value or 2, shape, device=device)
            else:
                x = torch.randn(shape, device=device)
                x = x.contiguous(memory_format=torch.channels_last) if image else x
            kind = torch.device(device).type
            with torch.inference_mode(), torch.autocast(kind, dtype=torch.bfloat16):
                for _ in range(3):
                    model(x)
                if kind == "cuda":
                    torch.cuda.synchronize()
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    model(x).float().cpu()  # the server copies each output back too
                    n += 1
                wall = time.perf_counter() - t0
            rows.append({"model": name, "batch": batch, "forward_ms": round(1000 * wall / n, 3),
                         "samples_per_s": round(n * batch / wall, 1)})  # fmt: skip
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def find_max(url: str, tenant: str, held: dict[str, float], args) -> dict:
    """`gpulens load --find-max tenant` with the other tenant at its held rate."""
    tenants = [f"{tenant}:rate={args.start_rate}:slo_ms={SLO_MS:g}"]
    tenants += [f"{m}:rate={r:g}:slo_ms={SLO_MS:g}" for m, r in held.items()]
    cmd = gpulens("load", "--url", url, *sum((["--tenant", t] for t in tenants), []),
                  "--find-max", tenant, "--trial-s", str(args.trial_s), "--warmup", "1",
                  "--max-trials", str(args.max_trials), "--json", "--no-store")  # fmt: skip
    out = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    if out.returncode:
        return {"tenant": tenant, "error": out.stderr.strip()[-1500:]}
    doc = json.loads(out.stdout)
    fm = doc.get("find_max") or {}
    me = next(t for t in doc["tenants"] if t["model"] == tenant)
    return {"tenant": tenant, "held": held, "max_rate_rps": fm.get("max_rate_rps"),
            "find_max": fm, "at_max": me, "lateness_ms_p99": doc.get("loadgen_lateness_ms_p99"),
            "server": doc.get("server")}  # fmt: skip


def one_setting(max_batch: int, args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = gpulens("serve", *sum((["--model", m] for m in MODELS), []), "--device", args.device,
                  "--max-batch", str(max_batch), "--max-queue-delay-ms", str(args.delay_ms),
                  "--port", str(port), "--no-store", "--json")  # fmt: skip
    home = tempfile.mkdtemp()
    proc = subprocess.Popen(cmd, env={**env(), "GPULENS_HOME": home}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_ready(url, proc)
        results = [
            find_max(url, "resnet50", {"bert-base": args.held_rate}, args),
            find_max(url, "bert-base", {"resnet50": args.held_rate}, args),
        ]
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=120)
    served = json.loads(out) if out.strip() else {"stderr": err[-1500:]}
    return {"max_batch": max_batch, "max_queue_delay_ms": args.delay_ms, "command": cmd[2:],
            "find_max": results, "server_summary": served}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--trial-s", type=float, default=5.0)
    ap.add_argument("--max-trials", type=int, default=8)
    ap.add_argument("--start-rate", type=float, default=100.0)
    ap.add_argument("--held-rate", type=float, default=50.0, help="The other tenant's req/s.")
    ap.add_argument("--delay-ms", type=float, default=2.0, help="--max-queue-delay-ms, batching")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    doc = {"slo_ms": SLO_MS, "plain_reference": plain_reference(args.device),
           "settings": [one_setting(32, args), one_setting(1, args)]}  # fmt: skip
    try:
        import torch

        doc["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - the name is a label only
        doc["gpu"] = None
    text = json.dumps(doc, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(f"{'model':10} {'batch':>5} {'fwd ms':>8} {'samples/s':>10}   (plain loop)")
    for r in doc["plain_reference"]:
        print(f"{r['model']:10} {r['batch']:5d} {r['forward_ms']:8.2f} {r['samples_per_s']:10.1f}")
    print(f"\n{'batching':10} {'tenant':10} {'held':>12} {'max req/s':>10} {'p99 ms':>8}")
    for s in doc["settings"]:
        label = f"max {s['max_batch']}"
        for r in s["find_max"]:
            if "error" in r:
                print(f"{label:10} {r['tenant']:10} error: {r['error'][-200:]}")
                continue
            p99 = (r["at_max"].get("latency_ms") or {}).get("p99")
            held = ",".join(f"{m}@{v:g}" for m, v in r["held"].items())
            print(f"{label:10} {r['tenant']:10} {held:>12} {r['max_rate_rps'] or 0:10.1f} "
                  f"{p99 or float('nan'):8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
