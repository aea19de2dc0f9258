"""Job specifications for ``gpulens colocate`` (no torch): what each job runs, and the
processes that run them.

Job syntax (parsed by :func:`parse_job`):

- ``resnet18`` or ``resnet18:batch=64,precision=bf16`` or ``train:resnet18:batch=64``: training
- ``infer:resnet50:batch=1,rate=200``: inference, ``rate`` requests/s at constant arrivals
  (latency counts from the scheduled arrival), closed loop without ``rate``;
  ``rate=200,arrivals=poisson`` draws the arrivals from a Poisson process of that mean rate;
  ``slo_ms=50`` adds the share of requests answered within 50 ms (SLO attainment) alone and
  together, so a set of inference tenants beside a training job shows the attainment lost
- ``serve:resnet50:rate=100,slo_ms=50``: a ``gpulens serve`` process serving the model over
  HTTP, driven at ``rate`` requests/s by the open-loop load generator (latency from each
  scheduled arrival; ``arrivals=poisson`` as for infer:, ``batch`` samples per request): a
  served tenant beside the other jobs, as its own process (time-slicing, MPS, MIG; not streams)
- ``cmd:python train.py --epochs 1``: any command; its throughput is runs per second (1/wall)
- what each job's throughput counts is its ``throughput_unit``: samples/s for training (steps
  x batch), requests/s for infer: and serve: tenants (samples/s when batch > 1, as each
  request then holds that many samples), runs/s for cmd:
- every built-in job takes ``name=...``; a name must be unique within one experiment
- ':' separates the options as well as ',' (``serve:resnet50:rate=100:slo_ms=50``, as
  ``gpulens load --tenant`` is written), and ``arrival=`` is read as ``arrivals=``
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from gpulens.errors import UsageError
from gpulens.workloads.schedule import Schedule

KINDS = ("train", "infer", "cmd", "serve")
# kinds that answer requests: an SLO applies, and an MPS thread limit for training skips them
SERVING_KINDS = ("infer", "serve")
PRECISIONS = ("fp32", "bf16", "fp16")
ARRIVALS = ("constant", "poisson")


def throughput_unit(kind: str, batch_size: int | None = None) -> str:
    """What a job's throughput counts, per second: a training job's samples (steps x batch),
    an inference or served tenant's requests (its samples when a request holds several), a
    ``cmd:`` job's whole runs (1 / its wall time)."""
    if kind == "cmd":
        return "runs/s"
    if kind in SERVING_KINDS:
        return "requests/s" if (batch_size or 1) == 1 else "samples/s"
    return "samples/s"


@dataclass(frozen=True)
class JobSpec:
    """One job of a collocation experiment. ``key`` identifies what runs (without the name)."""

    kind: str
    workload: str | None = None
    batch_size: int | None = None
    precision: str = "fp32"
    rate_per_s: float | None = None
    command: tuple[str, ...] = ()
    name: str = ""
    # How requests arrive at ``rate_per_s``: evenly spaced (constant) or a Poisson process.
    arrivals: str = "constant"
    # A latency target for an infer: job (ms from the scheduled arrival); None: no SLO.
    slo_ms: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UsageError(f"unknown job kind {self.kind!r}: use train, infer, serve or cmd")
        if self.kind == "cmd":
            if not self.command:
                raise UsageError("a cmd: job needs a command, e.g. 'cmd:python train.py'")
            return
        if self.kind == "serve":
            from gpulens.serve.loadgen import require_aiohttp
            from gpulens.serve.models import get_serve_model
            from gpulens.serve.runner import require_extra

            get_serve_model(self.workload or "")  # a usage error listing the servable models
            require_extra()  # the server's web framework, or one line naming the extra
            require_aiohttp()  # the load generator's client
            if self.rate_per_s is None:
                raise UsageError(
                    f"serve:{self.workload} needs rate=R (requests/s the load generator sends), "
                    f"e.g. serve:{self.workload}:rate=100,slo_ms=50"
                )
            default_batch = 1
        else:
            from gpulens.workloads.models import get_workload

            spec = get_workload(self.workload or "")
            default_batch = 1 if self.kind == "infer" else spec.default_batch_size
        if self.batch_size is not None and self.batch_size <= 0:
            raise UsageError(f"job {self.workload}: batch must be a positive integer")
        if self.precision not in PRECISIONS:
            raise UsageError(
                f"job {self.workload}: unknown precision {self.precision!r}; "
                f"use one of {', '.join(PRECISIONS)}"
            )
        serving = self.kind in SERVING_KINDS
        if self.rate_per_s is not None and (not serving or self.rate_per_s <= 0):
            raise UsageError(
                "rate= is for infer: and serve: jobs and must be positive requests per second"
            )
        if self.slo_ms is not None and (not serving or not self.slo_ms > 0):
            raise UsageError(
                "slo_ms= is for infer: and serve: jobs and must be a positive latency in ms"
            )
        if self.arrivals not in ARRIVALS:
            raise UsageError(
                f"job {self.workload}: unknown arrivals {self.arrivals!r}; use constant or poisson"
            )
        if self.arrivals != "constant" and self.rate_per_s is None:
            raise UsageError(f"job {self.workload}: arrivals= needs rate= (requests per second)")
        if self.batch_size is None:
            object.__setattr__(self, "batch_size", default_batch)
        if not self.name:
            object.__setattr__(self, "name", self.workload if self.kind == "train" else
                               f"{self.kind}-{self.workload}")  # fmt: skip

    @property
    def builtin(self) -> bool:
        """Whether the job is a loop of colocate's own (train, infer): it can share a process
        and its streams with other such jobs, and its peak memory is measured."""
        return self.kind in ("train", "infer")

    @property
    def throughput_unit(self) -> str:
        return throughput_unit(self.kind, self.batch_size)

    @property
    def key(self) -> str:
        """Canonical description without the name: equal keys run the same thing."""
        if self.kind == "cmd":
            return "cmd:" + shlex.join(self.command)
        opts = f"batch={self.batch_size},precision={self.precision}"
        if self.rate_per_s is not None:
            opts += f",rate={self.rate_per_s:g}"
        if self.arrivals != "constant":
            opts += f",arrivals={self.arrivals}"
        return f"{self.kind}:{self.workload}:{opts}"

    def schedule(self, seed: int = 0) -> Schedule:
        """When the job's steps start: closed loop, or its requests' arrivals."""
        if self.rate_per_s is None:
            return Schedule()
        return Schedule(self.arrivals, self.rate_per_s, seed)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["command"] = list(self.command)
        d["key"] = self.key
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobSpec:
        return cls(
            kind=d["kind"], workload=d.get("workload"), batch_size=d.get("batch_size"),
            precision=d.get("precision", "fp32"), rate_per_s=d.get("rate_per_s"),
            command=tuple(d.get("command") or ()), name=d.get("name") or "",
            arrivals=d.get("arrivals") or "constant", slo_ms=d.get("slo_ms"),
        )  # fmt: skip


_OPTION_NAMES = {"batch", "precision", "rate", "arrivals", "name", "slo_ms"}
_OPTION_ALIASES = {"arrival": "arrivals"}  # gpulens load --tenant's spelling
JOB_FORMAT = "[train:|infer:|serve:]WORKLOAD[:key=value,key=value...]"


def parse_job(text: str) -> JobSpec:
    """``[train:|infer:|serve:]WORKLOAD[:k=v,...]`` (or ``:k=v:k=v``) or ``cmd:COMMAND``; see
    the module docstring."""
    text = text.strip()
    if not text:
        raise UsageError("an empty job: give e.g. resnet18:batch=64 or infer:resnet50")
    if text.startswith("cmd:"):
        argv = shlex.split(text[4:])
        name = Path(argv[0]).name if argv else ""
        return JobSpec("cmd", command=tuple(argv), name=name)
    parts = text.split(":")
    kind = "train"
    if parts[0] in ("train", "infer", "serve"):
        kind, parts = parts[0], parts[1:]
    if not parts or not parts[0]:
        raise UsageError(
            f"cannot read job {text!r}: use WORKLOAD[:batch=N,precision=bf16], "
            "infer:WORKLOAD[:batch=1,rate=R], serve:MODEL:rate=R or cmd:COMMAND"
        )
    opts: dict[str, str] = {}
    rest = ":".join(parts[1:])  # the options: ',' or ':' between them (no value holds either)
    for item in re.split(r"[:,]", rest) if rest else []:
        k, sep, v = item.partition("=")
        k = _OPTION_ALIASES.get(k, k)
        if not sep or k not in _OPTION_NAMES or not v:
            raise UsageError(
                f"job {text!r}: bad option {item!r}; write {JOB_FORMAT} (':' between options "
                f"works too) with keys {', '.join(sorted(_OPTION_NAMES))}"
            )
        opts[k] = v
    try:
        batch = int(opts["batch"]) if "batch" in opts else None
        rate = float(opts["rate"]) if "rate" in opts else None
        slo_ms = float(opts["slo_ms"]) if "slo_ms" in opts else None
    except ValueError:
        raise UsageError(
            f"job {text!r}: batch must be an integer, rate and slo_ms numbers"
        ) from None
    return JobSpec(
        kind, parts[0], batch_size=batch, precision=opts.get("precision", "fp32"),
        rate_per_s=rate, name=opts.get("name", ""), arrivals=opts.get("arrivals", "constant"),
        slo_ms=slo_ms,
    )  # fmt: skip


def unique_names(jobs: list[JobSpec]) -> list[JobSpec]:
    """Give repeated names a suffix: resnet18, resnet18 -> resnet18#1, resnet18#2."""
    counts: dict[str, int] = {}
    for j in jobs:
        counts[j.name] = counts.get(j.name, 0) + 1
    seen: dict[str, int] = {}
    out = []
    for j in jobs:
        if counts[j.name] > 1:
            seen[j.name] = seen.get(j.name, 0) + 1
            j = replace(j, name=f"{j.name}#{seen[j.name]}")
        out.append(j)
    return out


# ------------------------------------------------------------------------------ process side
@dataclass
class ProcessSpec:
    """What one job process runs (written as JSON by the parent)."""

    jobs: list[dict[str, Any]]
    device: str
    duration_s: float
    warmup_s: float
    ready_file: str
    go_file: str
    result_file: str
    stream_priorities: list[int | None] = field(default_factory=list)
    cpu_threads: int | None = None
    seed: int = 0


GO_POLL_S = 0.002


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` atomically (the parent polls for the file)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def wait_for_go(go_file: str, parent_pid: int) -> float:
    """The common start time the parent writes to ``go_file``; exits if the parent dies."""
    while True:
        try:
            return float(Path(go_file).read_text())
        except (FileNotFoundError, ValueError):
            pass
        if os.getppid() != parent_pid:  # the parent died: do not wait forever
            raise SystemExit("gpulens colocate: parent process is gone")
        time.sleep(GO_POLL_S)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default) of a non-empty list; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
