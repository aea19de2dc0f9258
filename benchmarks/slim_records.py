"""Shrink a tarball of run records for committing: each torch_trace.json keeps only what
`gpulens predict` reads (CUDA kernels, device memsets and copies, the ops that launched them
with their shapes, and the CUDA runtime calls' names and times); everything else of the records
is kept as it is. Slimming a slimmed tarball again keeps it as it is.

    python benchmarks/slim_records.py RECORDS.tgz OUT.tar.xz

OUT is xz-compressed where it ends in .tar.xz (a third smaller than gzip: the committed tree
must stay under the 64 MiB the device copies), gzip otherwise.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile

DEVICE_CATS = ("kernel", "gpu_memset", "gpu_memcpy")
OP_ARGS = ("External id", "Input Dims", "Input type", "Concrete Inputs")
# what gpulens.predict reads of a kernel, memset or copy besides its name and times: the op
# that launched it and its stream (occupancy, grid and registers are dropped: the committed
# tree must stay under the device copy's 64 MiB)
DEVICE_ARGS = ("External id", "stream", "correlation", "device")


def slim_trace(doc: dict) -> dict:
    events = doc.get("traceEvents") or []
    device = [
        {**e, "args": {k: v for k, v in (e.get("args") or {}).items() if k in DEVICE_ARGS}}
        for e in events
        if e.get("cat") in DEVICE_CATS
    ]
    linked = {(e.get("args") or {}).get("External id") for e in device}
    ops = [
        {**e, "args": {k: v for k, v in (e.get("args") or {}).items() if k in OP_ARGS}}
        for e in events
        if e.get("cat") == "cpu_op" and (e.get("args") or {}).get("External id") in linked
    ]
    # the CUDA runtime calls without their arguments: the host's issue time per step
    # (gpulens.predict.trace.host_issue_s_per_step) reads their names, threads and times
    runtime = [
        {k: e[k] for k in ("ph", "cat", "name", "pid", "tid", "ts", "dur") if k in e}
        for e in events
        if e.get("cat") == "cuda_runtime"
    ]
    kept = {k: v for k, v in doc.items() if k != "traceEvents"}
    return {**kept, "traceEvents": ops + device + runtime, "slimmed": "benchmarks/slim_records.py"}


def main(src: str, dst: str) -> int:
    with (
        tarfile.open(src) as tin,
        tarfile.open(dst, "w:xz" if dst.endswith(".tar.xz") else "w:gz") as tout,
    ):
        for member in tin.getmembers():
            data = tin.extractfile(member).read() if member.isfile() else None
            if data is not None and member.name.endswith("torch_trace.json"):
                data = json.dumps(slim_trace(json.loads(data)), separators=(",", ":")).encode()
                member.size = len(data)
            tout.addfile(member, io.BytesIO(data) if data is not None else None)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
