"""Issue 16 on a GPU: the generative tenant. `gpulens serve --model gpt` (GPT-2 small, random
weights, bf16 autocast, KV cache, continuous batching) driven by `gpulens load --openai gpt` at
a few Poisson rates: achieved rate, time to first token and per output token (p50/p99), request
latency and tokens/s, from the client's side.

Beside it, in the same call, two references without the server on the same model and device:
- plain: a plain PyTorch greedy loop, the whole sequence through ``GPT.forward`` per token (what
  the model gives without a cache), at batch 1 and at --max-batch;
- cached: the server's own engine (:class:`gpulens.serve.kv_decode.CachedGPT`) in a loop, so
  the server's overhead reads as the gap to it.

    python benchmarks/serve_llm_gpu.py --out $OUT/serve_llm_gpu.json      # about 3 minutes
    python benchmarks/serve_llm_gpu.py --device cpu --model gpt_tiny --rates 2,4 \\
        --prompt-tokens 4 --max-tokens 16 --duration 3 --max-batch 8    # a CPU check

Prompts are ``--prompt-tokens`` copies of " the": 4 byte-level tokens each for gpulens serve
(gpulens load is asked for 4 x that many tokens, which it counts by the server's tokenizer).
The serve extra must be installed (on a machine without network, from wheels:
`pip install --no-index --find-links .whl starlette uvicorn aiohttp`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from serve_gpu import env, free_port, gpulens, wait_ready  # this folder's serving helpers

ROOT = Path(__file__).resolve().parents[1]
PROMPT_WORD = " the"


def references(args) -> list[dict]:
    """Tokens/s of a plain full-recompute greedy loop and of the cached engine, no server."""
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    from gpulens.serve.kv_decode import CachedGPT
    from gpulens.serve.models import get_serve_model

    device = torch.device(args.device)
    gpt = get_serve_model(args.model).build().lm.eval().to(device)
    prompt = list((PROMPT_WORD * args.prompt_tokens).encode())
    kind = device.type
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32

    def sync() -> None:
        if kind == "cuda":
            torch.cuda.synchronize()

    def plain(batch: int) -> None:
        ids = torch.tensor([prompt] * batch, device=device)
        for _ in range(args.max_tokens):
            nxt = gpt(ids)[:, -1, :256].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)

    def cached(batch: int) -> None:
        engine = CachedGPT(gpt, batch, device, dtype)
        logits = engine.prefill([prompt] * batch, list(range(batch)))
        lengths = torch.full((batch,), len(prompt), device=device)
        for _ in range(args.max_tokens - 1):
            logits = engine.decode(logits[:, :256].argmax(-1), lengths)
            lengths = lengths + 1

    rows = []
    for name, fn in (("plain", plain), ("cached", cached)):
        for batch in sorted({1, args.max_batch}):
            ctx = torch.autocast(kind, dtype=dtype) if kind == "cuda" else contextlib.nullcontext()
            with torch.inference_mode(), ctx:
                fn(batch)  # warm-up
                sync()
                t0 = time.perf_counter()
                fn(batch)
                sync()
                wall = time.perf_counter() - t0
            rows.append({"loop": name, "batch": batch, "prompt_tokens": len(prompt),
                         "new_tokens": args.max_tokens, "wall_s": round(wall, 4),
                         "tokens_per_s": round(batch * args.max_tokens / wall, 1),
                         "ms_per_step": round(1000 * wall / args.max_tokens, 3)})  # fmt: skip
    return rows


def load_at(url: str, rate: float, args) -> dict:
    cmd = gpulens("load", "--url", url, "--tenant", f"{args.model}:rate={rate:g}",
                  # gpulens load counts the server's tokens (4 a word here): the same prompt
                  "--openai", args.model, "--prompt-tokens", str(4 * args.prompt_tokens),
                  "--max-tokens", str(args.max_tokens), "--duration", str(args.duration),
                  "--warmup", str(args.warmup), "--timeout-s", "120", "--json",
                  "--no-store")  # fmt: skip
    out = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    if out.returncode:
        return {"rate_rps": rate, "error": out.stderr.strip()[-1500:]}
    doc = json.loads(out.stdout)
    (t,) = doc["tenants"]
    return {"rate_rps": rate, "achieved_rps": t["achieved_rate_rps"],
            "tokens_per_s": round(t["achieved_rate_rps"] * args.max_tokens, 1),
            "latency_ms": t["latency_ms"], "ttft_ms": t.get("ttft_ms"),
            "tpot_ms": t.get("tpot_ms"), "errors": t["errors"],
            "lateness_ms_p99": doc.get("loadgen_lateness_ms_p99"), "server": doc.get("server"),
            "command": cmd[2:]}  # fmt: skip


def serve_and_load(args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = gpulens("serve", "--model", args.model, "--device", args.device, "--max-batch",
                  str(args.max_batch), "--port", str(port), "--no-store", "--json")  # fmt: skip
    home = tempfile.mkdtemp()
    proc = subprocess.Popen(cmd, env={**env(), "GPULENS_HOME": home}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_ready(url, proc, path="/v1/models")
        rows = [load_at(url, r, args) for r in args.rates]
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=120)
    served = json.loads(out) if out.strip() else {"stderr": err[-1500:]}
    return {"command": cmd[2:], "rates": rows, "server_summary": served}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model", default="gpt", help="gpt (GPT-2 small) or gpt_tiny")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                    default=[2.0, 8.0, 32.0], help="requests/s, comma-separated")  # fmt: skip
    ap.add_argument("--prompt-tokens", type=int, default=32, help="words of the prompt")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    default_out = Path(os.environ["OUT"]) / "serve_llm_gpu.json" if "OUT" in os.environ else None
    ap.add_argument("--out", type=Path, default=default_out)
    args = ap.parse_args()
    doc = {"model": args.model, "device": args.device, "max_batch": args.max_batch,
           "prompt_words": args.prompt_tokens, "max_tokens": args.max_tokens,
           "reference": references(args), "serve": serve_and_load(args)}  # fmt: skip
    try:
        import torch

        doc["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - the name is a label only
        doc["gpu"] = None
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{'loop':8} {'batch':>5} {'ms/step':>8} {'tokens/s':>9}   (no server)")
    for r in doc["reference"]:
        print(f"{r['loop']:8} {r['batch']:5d} {r['ms_per_step']:8.2f} {r['tokens_per_s']:9.1f}")

    def p(d, k) -> str:
        v = (d or {}).get(k)
        return "-" if v is None else f"{v:.1f}"

    print(f"\n{'req/s':>6} {'got/s':>6} {'tok/s':>7} {'TTFT p50':>8} {'p99':>7} "
          f"{'TPOT p50':>8} {'p99':>6} {'lat p50':>8} {'p99':>7} {'err':>4}")  # fmt: skip
    for r in doc["serve"]["rates"]:
        if "error" in r:
            print(f"{r['rate_rps']:6g} error: {r['error'][-200:]}")
            continue
        print(f"{r['rate_rps']:6g} {r['achieved_rps']:6.2f} {r['tokens_per_s']:7.1f} "
              f"{p(r['ttft_ms'], 'p50'):>8} {p(r['ttft_ms'], 'p99'):>7} "
              f"{p(r['tpot_ms'], 'p50'):>8} {p(r['tpot_ms'], 'p99'):>6} "
              f"{p(r['latency_ms'], 'p50'):>8} {p(r['latency_ms'], 'p99'):>7} "
              f"{r['errors']['count']:4d}")  # fmt: skip


if __name__ == "__main__":
    main()
