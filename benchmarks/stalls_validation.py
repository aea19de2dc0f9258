"""Validate the stall breakdown against injected ground truth (issue 3).

Injects storage latency at several levels (the dataset reader's slow-storage emulation) and
limits the loader workers, then compares the fetch and prep stall shares that the differential
method reports with those expected from the injected delays (see
``gpulens.experiments.stalls_validation``). Target: within 3 percentage points.

    python benchmarks/stalls_validation.py --data DIR [--workload resnet18] [--workers 1,2,4]
        [--latencies-ms 2,5,10] [--batch-size 64] [--steps 60] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import date
from pathlib import Path

from gpulens.experiments.stalls_validation import validate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--workload", default="resnet18")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--latencies-ms", default="2,5,10")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--device", default=None)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        df = validate(
            args.workload, args.data, Path(tmp),
            latencies_s=tuple(float(x) / 1000 for x in args.latencies_ms.split(",")),
            workers=tuple(int(x) for x in args.workers.split(",")),
            batch_size=args.batch_size, steps=args.steps, device=args.device,
            precision=args.precision,
        )  # fmt: skip
    doc = {
        "benchmark": "stalls_validation",
        "date": date.today().isoformat(),
        "command": " ".join(["python", *sys.argv]),
        "target_max_error_pp": 3.0,
        "rows": df.to_dict(orient="records"),
    }
    out = args.out or Path(
        os.environ.get("OUT", "benchmarks/results"), f"stalls_validation-{doc['date']}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str))
    cols = ["workers", "latency_ms", "fetch_expected_pct", "fetch_measured_pct", "fetch_error_pp",
            "prep_expected_pct", "prep_measured_pct", "prep_error_pp"]  # fmt: skip
    print(df[cols].round(2).to_string(index=False))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
