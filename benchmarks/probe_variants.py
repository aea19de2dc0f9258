"""Copies of a workers-ladder bundle without some of its runs' loader probes, so that
predict_same_gpu.py scores the same runs as `gpulens predict --workers` reads them with each
probe, with the other, and with none (the predictor reads the pipeline probe where a run has
it, else the process probe, else neither):

    python benchmarks/probe_variants.py BUNDLE.tar.xz OUT_DIR

writes OUT_DIR/<bundle>-process_probe.tar.xz (no loader_pipeline_scaling) and
OUT_DIR/<bundle>-no_probe.tar.xz (neither); every other byte of the records is kept.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

VARIANTS = {
    "process_probe": ("loader_pipeline_scaling",),
    "no_probe": ("loader_pipeline_scaling", "loader_scaling"),
}


def without(bundle: Path, out: Path, keys: tuple[str, ...]) -> int:
    """Write ``bundle`` to ``out`` with ``keys`` removed from every run.json; the runs changed."""
    changed = 0
    with tarfile.open(bundle) as tin, tarfile.open(out, "w:xz") as tout:
        for member in tin:
            data = tin.extractfile(member).read() if member.isfile() else None
            if data is not None and member.name.endswith("/run.json"):
                meta = json.loads(data)
                if any(meta.pop(k, None) is not None for k in keys):
                    changed += 1
                data = json.dumps(meta, indent=1).encode()
                member.size = len(data)
            tout.addfile(member, io.BytesIO(data) if data is not None else None)
    return changed


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python benchmarks/probe_variants.py BUNDLE.tar.xz OUT_DIR", file=sys.stderr)
        return 2
    bundle, out_dir = Path(argv[0]), Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = bundle.name.split(".tar")[0]
    for name, keys in VARIANTS.items():
        out = out_dir / f"{stem}-{name}.tar.xz"
        print(f"{out}: {without(bundle, out, keys)} runs changed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
