"""Issue 15 on a GPU: an unmodified script (examples/train_plain.py) run plainly and under
`gpulens run --` (step timing injected), interleaved (plain/injected, then injected/plain, ...).

Reports per pair: the script's own throughput both ways (the cost of injection, as the script
itself sees it), and in the injected run gpulens's throughput against the script's own (the
agreement: both count the same steps after the same warm-up). Prints a table; --out writes JSON.

    PYTHONPATH=src python benchmarks/inject_check.py --pairs 3 --steps 150 --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def last_json(text: str) -> dict:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and "samples_per_s" in line:
            return json.loads(line)
    raise RuntimeError(f"no result line in: {text[-1000:]}")


def run(script_args: list[str], injected: bool, home: Path) -> dict:
    script = [sys.executable, str(ROOT / "examples" / "train_plain.py"), *script_args]
    env = dict(os.environ, GPULENS_HOME=str(home))
    t = time.perf_counter()
    if not injected:
        out = subprocess.run(script, capture_output=True, text=True, env=env, check=True)
        return {"script": last_json(out.stdout), "wall_s": time.perf_counter() - t}
    cmd = [sys.executable, "-m", "gpulens.cli", "run", "--no-store", "--json", "--", *script]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    doc = json.loads(out.stdout)
    return {"script": last_json(out.stderr), "gpulens": doc, "wall_s": time.perf_counter() - t}


def interval95(xs: list[float]) -> list[float] | None:
    from gpulens.stats import t95

    if len(xs) < 2:
        return None
    m, sd = statistics.fmean(xs), statistics.stdev(xs)
    h = t95(len(xs) - 1) * sd / len(xs) ** 0.5
    return [round(m - h, 4), round(m + h, 4)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args()
    # gpulens's injected tracker excludes its first 5 steps; the script excludes the same.
    script_args = ["--model", args.model, "--batch-size", str(args.batch_size), "--steps",
                   str(args.steps), "--warmup", "5", "--workers", str(args.workers)]  # fmt: skip
    home = Path(tempfile.mkdtemp(prefix="gpulens-inject-"))
    pairs = []
    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {inj: run(script_args, inj, home) for inj in order}
        plain, inj = got[False], got[True]
        g = inj["gpulens"]
        pair = {
            "plain_script_samples_per_s": plain["script"]["samples_per_s"],
            "injected_script_samples_per_s": inj["script"]["samples_per_s"],
            "gpulens_samples_per_s": g.get("throughput_samples_per_s"),
            "gpulens_ci95_pct": g.get("throughput_ci95_pct"),
            "gpulens_measured_steps": g.get("measured_steps"),
            "gpulens_phases_s": g.get("phases_s"),
            "final_loss_plain": plain["script"]["final_loss"],
            "final_loss_injected": inj["script"]["final_loss"],
        }
        pair["cost_ratio"] = (
            pair["injected_script_samples_per_s"] / pair["plain_script_samples_per_s"]
        )
        pair["agreement_ratio"] = (pair["gpulens_samples_per_s"] or 0) / pair[
            "injected_script_samples_per_s"
        ]
        pairs.append(pair)
        print(f"pair {i}: plain {pair['plain_script_samples_per_s']:.1f}, injected "
              f"{pair['injected_script_samples_per_s']:.1f} (script's own), gpulens "
              f"{pair['gpulens_samples_per_s'] or 0:.1f}", flush=True)  # fmt: skip
    cost = [p["cost_ratio"] for p in pairs]
    agree = [p["agreement_ratio"] for p in pairs]
    import torch

    doc = {
        "benchmark": "inject_check",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "script_args": script_args,
        "pairs": pairs,
        "cost_ratio_median": statistics.median(cost),
        "cost_ratio_ci95": interval95(cost),
        "agreement_ratio_median": statistics.median(agree),
        "agreement_ratio_ci95": interval95(agree),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"\n{doc['gpu']}: {args.model} b{args.batch_size}, {args.pairs} pairs")
    print(f"injected / plain (script's own throughput): median {doc['cost_ratio_median']:.4f} "
          f"{doc['cost_ratio_ci95']}")  # fmt: skip
    print(f"gpulens / script (same injected run):       median "
          f"{doc['agreement_ratio_median']:.4f} {doc['agreement_ratio_ci95']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
