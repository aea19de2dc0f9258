"""Shrink a tarball of run records for committing: each torch_trace.json keeps only what
`gpulens predict` reads (CUDA kernels, device memsets and copies, the ops that launched them
with their shapes, and the CUDA runtime calls' names and times); everything else of the records
is kept as it is. Slimming a slimmed tarball again keeps it as it is.

    python benchmarks/slim_records.py RECORDS.tgz OUT.tar.xz [--drop-loader-bound-prep-rows]

With --drop-loader-bound-prep-rows, the per-sample prep rows (``series/prep_*.arrows``, most of a
workers ladder's bytes) of runs that waited for their loader are dropped too: `predict` takes
such a run's loader pace from its step, never from those rows. A note in ``runs/slimmed.json``
lists the runs they were dropped from.

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


def loader_bound_runs(tin: tarfile.TarFile) -> set[str]:
    """The record directories (member paths) whose run waited for its loader, as `predict`
    judges it (data wait above LOADER_BOUND_SHARE of the step)."""
    from gpulens.predict.predictor import LOADER_BOUND_SHARE

    bound = set()
    for member in tin.getmembers():
        if member.isfile() and member.name.endswith("/run.json"):
            phases = (json.load(tin.extractfile(member)).get("summary") or {}).get("phases_s")
            wait, step = (phases or {}).get("data_wait"), (phases or {}).get("step")
            if wait is not None and step and wait > LOADER_BOUND_SHARE * step:
                bound.add(member.name.rsplit("/", 1)[0])
    return bound


def main(src: str, dst: str, drop_loader_bound_prep_rows: bool = False) -> int:
    with (
        tarfile.open(src) as tin,
        tarfile.open(dst, "w:xz" if dst.endswith(".tar.xz") else "w:gz") as tout,
    ):
        bound = loader_bound_runs(tin) if drop_loader_bound_prep_rows else set()
        dropped = set()
        for member in tin.getmembers():
            head, _, name = member.name.rpartition("/series/")
            if head in bound and name.startswith("prep_") and name.endswith(".arrows"):
                dropped.add(head)
                continue
            data = tin.extractfile(member).read() if member.isfile() else None
            if data is not None and member.name.endswith("torch_trace.json"):
                data = json.dumps(slim_trace(json.loads(data)), separators=(",", ":")).encode()
                member.size = len(data)
            tout.addfile(member, io.BytesIO(data) if data is not None else None)
        if dropped:
            note = {
                "dropped": "series/prep_*.arrows (per-sample loader timing)",
                "why": "loader-bound runs: predict reads their loader pace from the step",
                "by": "benchmarks/slim_records.py --drop-loader-bound-prep-rows",
                "runs": sorted(d.rsplit("/", 1)[-1] for d in dropped),
            }
            data = json.dumps(note, indent=1).encode()
            info = tarfile.TarInfo("runs/slimmed.json")
            info.size = len(data)
            tout.addfile(info, io.BytesIO(data))
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    flag = "--drop-loader-bound-prep-rows"
    sys.exit(main(*[a for a in args if a != flag][:2], drop_loader_bound_prep_rows=flag in args))
