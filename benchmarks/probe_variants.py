"""A copy of a workers-ladder bundle without its runs' loader probes, so that
predict_same_gpu.py scores the same runs as `gpulens predict --workers` reads them without the
probe (linear in the workers) beside the bundle itself (with it):

    python benchmarks/probe_variants.py BUNDLE.tar.xz OUT_DIR

writes OUT_DIR/<bundle>-no_probe.tar.xz; every other byte of the records is kept. The f451548
bundles also hold a pipeline probe (the run's own DataLoader timed at 1, 2, 4, ... workers),
tried in session 23 and not kept; it goes too.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

VARIANTS = {"no_probe": ("loader_pipeline_scaling", "loader_scaling")}


def without(bundle: Path, out: Path, keys: tuple[str, ...]) -> int:
    """Write ``bundle`` to ``out`` with ``keys`` removed from every run.json; the runs changed."""
    changed = 0
    with tarfile.open(bundle) as tin, tarfile.open(out, "w:xz") as tout:
        for member in tin:
            data = tin.extractfile(member).read() if member.isfile() else None
            if data is not None and member.name.endswith("/run.json"):
                meta = json.loads(data)
                removed = [meta.pop(k) for k in keys if k in meta]  # every key, not the first
                changed += bool(removed)
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
