"""Recompute a stall breakdown from the run records `gpulens stalls` left behind.

Reads every stall run under RUNS (a runs folder, or a .tgz of one such as
benchmarks/results/stalls-resnet50-records-*.tgz), groups the runs by their stored role (records
made before roles were stored get the role their name implies; a paired cold run is never pooled
as a plain cold one), pools repeats of a role, and prints the breakdown with its 95% intervals
as JSON. Needs no torch.

    python benchmarks/stalls_from_records.py RUNS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gpulens.stalls import StallAnalysis


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    analysis = StallAnalysis.from_records(Path(sys.argv[1]))
    print(json.dumps(analysis.breakdown(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
