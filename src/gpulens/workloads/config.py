"""What a training run asks for (``TrainConfig``) and what it runs with
(``EffectiveTrainConfig``, made by ``resolve_config``).

Importable without torch: the requested config is checked here as far as it can be without a
device; what needs the device (fp16 on a CPU) is checked when the config is resolved against it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpulens.data.affinity import WORKER_AFFINITIES
from gpulens.errors import UsageError
from gpulens.launch.multinode import NodeTopology
from gpulens.probes.environment import usable_cpus

if TYPE_CHECKING:
    from gpulens.workloads.models import WorkloadSpec

PRECISIONS = ("fp32", "bf16", "fp16")
DEFAULT_STEPS = 100
# With --until-ci and no budget, stop after this long whatever the interval.
DEFAULT_UNTIL_CI_BUDGET_S = 600.0
NCCL_TRANSPORTS = ("default", "socket")
LOADER_PREFETCH = 2  # batches each data-loader worker prepares ahead (PyTorch's default)


@dataclass
class TrainConfig:
    """What the user asked for. ``None`` means "gpulens chooses"; the choice lands in the
    effective config."""

    workload: str
    batch_size: int | None = None
    steps: int | None = None
    duration_s: float | None = None
    # Stop after this many measured seconds even before ``steps`` (a caller's time budget, as
    # `gpulens stalls --time-budget` gives its cold pass); ``duration_s`` is a run's length.
    duration_cap_s: float | None = None
    warmup_steps: int | None = None
    device: str | None = None
    precision: str = "fp32"
    workers: int | None = None
    data: str = "synthetic"
    until_ci_pct: float | None = None
    sample_hz: float = 10.0
    count_flops: bool = True
    channels_last: bool | None = None
    seed: int = 0
    name: str | None = None
    # Slow-storage emulation in the dataset reader (what-if runs, validation of attributions).
    storage_latency_s: float = 0.0
    storage_bandwidth_bytes_per_s: float | None = None
    # Time read, decode, augment and collate in the loader workers (series prep_w*).
    prep_timing: bool = False
    # After the measured window, time the dataset at 1..N concurrent processes (loader_scaling
    # in run.json, for `predict --workers`; a few seconds, so `gpulens run --prep-timing` asks
    # for it and the several runs of `gpulens stalls` do not).
    loader_probe: bool = False
    # Data-parallel training (DDP): one process per GPU, each with ``batch_size`` samples.
    gpus: int = 1
    # NCCL transport between the GPUs: "default" (P2P/NVLink where NCCL finds it) or "socket"
    # (no P2P, no shared memory: NCCL's network transport over TCP, as between hosts).
    nccl_transport: str = "default"
    ddp_bucket_mb: float | None = None
    # Loader workers: "os" (where the scheduler puts them) or "cores" (one physical core each).
    worker_affinity: str = "os"
    # Paired cold reading (``gpulens stalls``): the loader workers alternate, every this many
    # samples, between the half of the files kept in the page cache and the other half, which
    # the caller evicted (or which storage emulation slows down); the run ends when that half
    # is used up. Needs an image folder and prep timing.
    paired_cold_block: int | None = None
    # Images that cannot be decoded: stop with an error naming the file (False), or put the
    # next readable image in their place and count them in the summary (True).
    skip_bad_samples: bool = False
    # Steps run under torch.profiler after the measured window (its trace kept in the record).
    torch_profiler_steps: int = 0
    # A run over several nodes: this node's place (``gpus`` processes on each node).
    nodes: NodeTopology | None = None

    def __post_init__(self) -> None:
        if self.batch_size is not None and self.batch_size <= 0:
            raise UsageError(f"--batch-size must be a positive integer, got {self.batch_size}")
        if self.steps is not None and self.steps <= 0:
            raise UsageError(f"--steps must be a positive integer, got {self.steps}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise UsageError(f"--duration must be positive seconds, got {self.duration_s}")
        if self.steps is not None and self.duration_s is not None:
            raise UsageError("give either --steps or --duration, not both")
        if self.duration_cap_s is not None and self.duration_cap_s <= 0:
            raise ValueError(f"a duration cap must be positive seconds, got {self.duration_cap_s}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise UsageError(f"--warmup-steps must be zero or more, got {self.warmup_steps}")
        if self.precision not in PRECISIONS:
            raise UsageError(
                f"unknown precision '{self.precision}': use one of {', '.join(PRECISIONS)}"
            )
        if self.workers is not None and self.workers < 0:
            raise UsageError(f"--workers must be zero or more, got {self.workers}")
        if self.until_ci_pct is not None and not 0 < self.until_ci_pct < 100:
            raise UsageError(
                f"--until-ci must be a percentage in (0, 100), got {self.until_ci_pct}"
            )
        if self.sample_hz <= 0 or self.sample_hz > 1000:
            raise UsageError(f"--sample-hz must be in (0, 1000], got {self.sample_hz}")
        if self.gpus < 1:
            raise UsageError(f"--gpus must be 1 or more, got {self.gpus}")
        if self.nccl_transport not in NCCL_TRANSPORTS:
            raise UsageError(
                f"unknown NCCL transport '{self.nccl_transport}': use one of "
                f"{', '.join(NCCL_TRANSPORTS)}"
            )
        if self.gpus == 1 and self.nodes is None and self.nccl_transport != "default":
            raise UsageError("--nccl-transport needs --gpus 2 or more")
        if self.worker_affinity not in WORKER_AFFINITIES:
            raise UsageError(
                f"unknown worker affinity '{self.worker_affinity}': use one of "
                f"{', '.join(WORKER_AFFINITIES)}"
            )
        if self.torch_profiler_steps < 0:
            raise UsageError(
                f"--torch-profiler must be a number of steps (0 or more), got "
                f"{self.torch_profiler_steps}"
            )
        if self.torch_profiler_steps and (self.gpus > 1 or self.nodes is not None):
            raise UsageError("--torch-profiler profiles one process: leave out --gpus and --nnodes")
        if self.ddp_bucket_mb is not None and self.ddp_bucket_mb <= 0:
            raise UsageError(f"--ddp-bucket-mb must be positive, got {self.ddp_bucket_mb}")
        if self.data == "synthetic" and (
            self.storage_latency_s or self.storage_bandwidth_bytes_per_s
        ):
            raise UsageError("storage emulation needs on-disk data: give --data PATH")
        if self.paired_cold_block is not None:
            if self.paired_cold_block < 1:
                raise UsageError(
                    f"paired_cold_block must be 1 or more samples, got {self.paired_cold_block}"
                )
            if self.data == "synthetic" or not self.prep_timing or self.gpus > 1 or self.nodes:
                raise UsageError(
                    "paired cold reading needs on-disk data, prep timing and one process"
                )
        if self.data != "synthetic" and not Path(self.data).expanduser().exists():
            raise UsageError(
                f"dataset path {self.data} does not exist: make one with "
                f"`gpulens data make images --out {self.data} --n 1000` or use --data synthetic"
            )


def default_workers(data: str) -> int:
    if data == "synthetic":
        return 0
    return max(1, min(8, usable_cpus() - 1))


# Settings known only once the run has built its parts, or only for several processes: written
# into run.json only where set, as records before this type had them.
BUILT_FIELDS = (
    "paired_cold_samples",
    "paired_cold_max_steps",
    "dataset",
    "backend",
    "transport_env",
    "rendezvous_addr",
    "transport_effective",
    "nodes",
)


@dataclass(frozen=True)
class EffectiveTrainConfig:
    """What a training run runs with: every choice left to gpulens made (LoadGen's "effective
    settings", beside the requested ``TrainConfig``). Frozen: a stage that learns more (the
    optimizer built, the dataset read, the NCCL transport taken) makes a new one with
    :meth:`with_built`. ``as_dict()`` is the ``effective_config`` of run.json."""

    workload: str
    task: str
    batch_size: int
    steps: int | None
    duration_s: float | None
    warmup_steps: int
    device: str
    precision: str
    workers: int
    data: str
    until_ci_pct: float | None
    sample_hz: float
    count_flops: bool
    channels_last: bool
    storage_latency_s: float
    storage_bandwidth_bytes_per_s: float | None
    prep_timing: bool
    loader_probe: bool
    gpus: int
    nccl_transport: str
    ddp_bucket_mb: float | None
    worker_affinity: str
    paired_cold_block: int | None
    skip_bad_samples: bool
    seed: int
    optimizer: str | None = None
    # What the analysis of a paired cold run needs to draw the same cold half again.
    paired_cold_samples: int | None = None
    paired_cold_max_steps: int | None = None
    dataset: Mapping[str, Any] | None = None
    # Data-parallel runs only.
    backend: str | None = None
    transport_env: Mapping[str, str] | None = None
    rendezvous_addr: str | None = None
    transport_effective: tuple[str, ...] | None = None
    # Multi-node runs only: this node's NodeTopology as a dict.
    nodes: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"effective batch size must be positive, got {self.batch_size}")
        if self.warmup_steps < 0 or self.workers < 0:
            raise ValueError("effective warm-up steps and workers must be zero or more")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown effective precision {self.precision!r}")
        if self.steps is None and self.duration_s is None:
            raise ValueError("an effective config needs a step count or a duration")

    def with_built(self, **facts: Any) -> EffectiveTrainConfig:
        """This config with settings learnt while building or running (see BUILT_FIELDS)."""
        return replace(self, **facts)

    def as_dict(self) -> dict[str, Any]:
        """The run.json ``effective_config``: every setting, the built ones where set."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            # A paired run's length is None when it never runs out (a slowed, reused half).
            paired_length = f.name == "paired_cold_max_steps" and self.paired_cold_samples
            if f.name in BUILT_FIELDS and value is None and not paired_length:
                continue
            if isinstance(value, Mapping):
                value = dict(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> EffectiveTrainConfig:
        """The config a run.json ``effective_config`` holds. Records written before a setting
        existed get its default (what those runs ran with); keys it does not know are left."""
        defaults = TrainConfig.__dataclass_fields__
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in doc:
                values[f.name] = doc[f.name]
            elif f.name in defaults and defaults[f.name].default is not MISSING:
                values[f.name] = defaults[f.name].default
        if isinstance(values.get("transport_effective"), list):
            values["transport_effective"] = tuple(values["transport_effective"])
        return cls(**values)


def resolve_config(config: TrainConfig, spec: WorkloadSpec, device: Any) -> EffectiveTrainConfig:
    """The effective config: every choice left to gpulens made."""
    if device.type == "cpu" and config.precision == "fp16":
        # fp32 first: bf16 runs on any CPU, but on one without bf16 units (AVX2, 2 cores) a
        # resnet18 step at batch 8 took 14.4 s in bf16 and 1.03 s in fp32
        raise UsageError(
            "fp16 training needs a GPU: use --precision fp32 on the CPU (bf16 also runs, but "
            "far slower on CPUs without bf16 units)"
        )
    if config.until_ci_pct is not None:
        steps, duration = (
            config.steps,
            config.duration_s
            or config.duration_cap_s
            or (None if config.steps else DEFAULT_UNTIL_CI_BUDGET_S),
        )
    else:
        steps = config.steps if config.steps or config.duration_s else DEFAULT_STEPS
        duration = config.duration_s or config.duration_cap_s
    workers = config.workers if config.workers is not None else default_workers(config.data)
    warmup = config.warmup_steps
    if warmup is None:
        warmup = min(10, max(2, (steps or 50) // 10))
        if config.data != "synthetic":
            # The loader's queue starts full (workers x prefetch batches) and would hide a data
            # bottleneck from the first measured steps: drain it during warm-up.
            warmup = max(warmup, 2 * max(workers, 1) * LOADER_PREFETCH)
    channels_last = config.channels_last
    if channels_last is None:
        channels_last = device.type == "cuda" and spec.task == "image_classification"
    return EffectiveTrainConfig(
        workload=spec.name,
        task=spec.task,
        batch_size=config.batch_size or spec.default_batch_size,
        steps=steps,
        duration_s=duration,
        warmup_steps=warmup,
        device=str(device),
        precision=config.precision,
        workers=workers,
        data=config.data,
        until_ci_pct=config.until_ci_pct,
        sample_hz=config.sample_hz,
        count_flops=config.count_flops,
        channels_last=bool(channels_last),
        storage_latency_s=config.storage_latency_s,
        storage_bandwidth_bytes_per_s=config.storage_bandwidth_bytes_per_s,
        prep_timing=config.prep_timing,
        # the probe runs in a one-process run only (train.py, not the DDP launcher)
        loader_probe=config.loader_probe
        and workers > 0
        and config.data != "synthetic"
        and config.gpus == 1
        and not config.nodes,
        gpus=config.gpus,
        nccl_transport=config.nccl_transport,
        ddp_bucket_mb=config.ddp_bucket_mb,
        worker_affinity=config.worker_affinity,
        paired_cold_block=config.paired_cold_block,
        skip_bad_samples=config.skip_bad_samples,
        seed=config.seed,
    )
