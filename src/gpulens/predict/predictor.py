"""Step time and throughput of a measured run on another GPU, GPU count or network.

The stable API (``gpulens advise`` imports it): ``Target``, ``Prediction``, ``predict_run``.

A step is split as measured (rank 0's phases): data wait + host-to-device copy + compute
(+ loop bookkeeping). Compute splits into the GPU's time (CUDA events) and host time; only the
GPU's part is scaled, by the profiler window's kernels (``kernel_roofline``) or by the step's
FLOPs and bytes (``whole_step_roofline``), or by the regression of ``gpulens fit`` where its
held-out error is lower. The all-reduce comes from the ring model (``communication``). A run
whose loader could not keep up keeps its loader's pace: the data wait absorbs a faster GPU.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from gpulens.errors import UsageError
from gpulens.predict import batch as batch_model
from gpulens.predict import features, roofline, validation
from gpulens.predict.catalog import GpuSpec, find_gpu
from gpulens.predict.communication import Communication, communication, measured_pairs
from gpulens.predict.features import RunFacts, gradient_tensors, model_size, run_facts
from gpulens.predict.trace import read_kernels
from gpulens.predict.workers import worker_pace_ratio

log = logging.getLogger(__name__)

# A run whose data wait is above this share of its step was waiting for its loader.
LOADER_BOUND_SHARE = 0.05


@dataclass(frozen=True)
class Target:
    """Where to predict: ``gpus`` GPUs of type ``gpu`` (None: the measured run's) on each of
    ``nodes`` hosts joined by ``network_gbps``, at a per-GPU ``batch_size`` and with ``workers``
    loader processes per GPU (None: the measured run's)."""

    gpu: str | None
    gpus: int = 1
    nodes: int = 1
    network_gbps: float | None = None
    batch_size: int | None = None
    workers: int | None = None

    def __post_init__(self) -> None:
        if self.gpu is not None and (not isinstance(self.gpu, str) or not self.gpu.strip()):
            raise UsageError("give the target GPU: --gpu NAME (see the catalog, e.g. H100, A100)")
        for name in ("gpus", "nodes", "batch_size", "workers"):
            value = getattr(self, name)
            if value is None and name in ("batch_size", "workers"):
                continue
            low = 0 if name == "workers" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag} must be a whole number >= {low}, got {value!r}")
        gbps = self.network_gbps
        if gbps is not None and (not isinstance(gbps, (int, float)) or not 0 < gbps < math.inf):
            raise UsageError(f"--network-gbps must be a positive number, got {gbps!r}")
        if (self.nodes > 1) != (gbps is not None):  # the network is between nodes only
            raise UsageError("--nodes above 1 needs the network between them: --network-gbps B"
                             if gbps is None else "--network-gbps is the network between "
                             "nodes: give --nodes M (2 or more) with it")  # fmt: skip

    @property
    def total_gpus(self) -> int:
        return self.gpus * self.nodes


@dataclass(frozen=True)
class Prediction:
    source_run: str
    target: Target
    step_time_s: float
    throughput_samples_per_s: float
    components_s: dict[str, float]
    validated_error_pct: float | None
    method: str
    source_gpu: str = ""
    target_gpu: str = ""
    loader_bound: bool = False  # the source run waited for its loader: kept at that pace
    notes: tuple[str, ...] = field(default=())
    # its regimes (gpulens.predict.validation): who sets the pace, and whose error was weighed
    regimes: tuple[str, ...] = field(default=())
    beyond_validation: str | None = None  # what lies outside the validated GPUs and counts

    @property
    def measured_here(self) -> bool:
        """The run's own configuration (GPU, count, batch, workers): a measurement, not a
        prediction."""
        return _is_measured_here(self.method, self.regimes)

    def as_dict(self) -> dict[str, Any]:
        """The ``predict --json`` document."""
        doc = asdict(self)
        doc["notes"] = list(self.notes)
        return doc


def _is_measured_here(method: str, regimes) -> bool:
    """Nothing changed from the run (its GPU, count, batch and workers): no model applies."""
    return method == "same_gpu" and set(regimes) <= {"loader_bound"}


# Below this share of kernel time in the step, the host's speed matters as much as the GPU's.
HOST_BOUND_BUSY = 0.8
# `--batch-size` keeps a GPU-paced run's step beyond its kernels (batch.GPU_BOUND_FILL) and
# takes a host-paced run's step as the floor.
GPU_BOUND_FILL = batch_model.GPU_BOUND_FILL
# The host time DDP adds to issuing one step: its reducer's hook and bucket copy for every
# gradient tensor, and a fixed part (buckets' collectives, the backward's preparation). On a
# plain loop (benchmarks/ddp_overhead.sh, an H200 pair, 2026-11-26): vgg16 b64 (32 tensors)
# 2.96 ms, resnet18 b256 (62) 4.07, vit_b_16 b64 (152) 5.51, resnet50 b128 (161) 6.90; the
# least-squares line is 2.27 ms + 25.4 us per tensor (residuals within 0.63 ms). A workload
# whose tensors are not known takes the median, 4.8 ms. Where the host's pace (_ddp_host_floor)
# plus this outlasts the GPU's step, the host sets a DDP step's pace.
DDP_HOST_FIXED_S = 2.27e-3
DDP_HOST_PER_TENSOR_S = 25.4e-6
DDP_HOST_ISSUE_S = 4.8e-3


def ddp_host_issue_s(workload: str | None) -> float:
    """The host time DDP adds to one step of ``workload`` (seconds)."""
    tensors = gradient_tensors(workload)
    if tensors is None:
        return DDP_HOST_ISSUE_S
    return DDP_HOST_FIXED_S + DDP_HOST_PER_TENSOR_S * tensors


def _gpu_ratio(
    facts: RunFacts, core_s: float, src: roofline.Hardware, tgt: roofline.Hardware
) -> tuple[float, str, list[str], bool]:
    """Target/source GPU time of a step, the method, notes, and whether the host set the
    step's pace (its GPU ran kernels under HOST_BOUND_BUSY of it)."""
    kernels = read_kernels(facts.trace) if facts.trace is not None else []
    if kernels and facts.trace_steps > 0:
        ks = roofline.scale_kernels(kernels, facts.trace_steps, src, tgt)
        busy = min(1.0, ks.busy_s_per_step / core_s)
        bound = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in ks.seconds_by_bound.items())
        note = f"{ks.kernels} kernels over {facts.trace_steps} profiled steps ({bound} per step)"
        notes = [note]
        if busy < HOST_BOUND_BUSY:
            notes.append(
                f"the GPU ran kernels {busy:.0%} of the step's compute time; the rest (the "
                "host's launches and Python) is kept as measured, and another machine's CPU "
                "moves it"
            )
        return busy * ks.ratio + (1.0 - busy), "kernel_roofline", notes, busy < HOST_BOUND_BUSY
    flops = facts.flops_per_step
    if not flops:
        ddp = facts.gpus > 1  # a 2-GPU run of resnet50 was told "or on a built-in workload"
        raise UsageError(
            f"run {facts.run_id} has no FLOP count{' (a data-parallel run counts none)' * ddp} "
            "and no profiler window: rerun it with `gpulens run WORKLOAD --torch-profiler 5`"
            + (", or predict from a 1-GPU run of it" if ddp else "")
        )
    split = roofline.split_step(core_s, flops, facts.bytes_per_step(src.bandwidth_bytes_per_s), src)
    notes = [] if facts.trace is None else ["the profiler window holds no CUDA kernels"]
    notes += [
        f"GPU time per step: {split.compute_frac:.0%} FLOP-bound, {split.memory_frac:.0%} "
        f"bandwidth-bound, {split.latency_frac:.0%} latency-bound (kept)"
    ]
    if not split.bytes_measured:
        notes.append(
            f"no DRAM counter (GPM) in the run: bytes assumed at "
            f"{roofline.DEFAULT_FLOP_PER_BYTE:g} FLOP/byte"
        )
    # without a window, NVML's utilization (the share of time some kernel ran) over the part
    # of the step that was not the wait for data says whether kernels filled it
    util, rest_s = facts.gpu_util_pct, facts.step_s - facts.data_wait_s
    busy = min(1.0, util / 100 * facts.step_s / rest_s) if util is not None and rest_s > 0 else 1.0
    host_bound = busy < HOST_BOUND_BUSY
    if host_bound:
        note = f"the GPU ran kernels {busy:.0%} of the step beyond its wait for data (NVML)"
        notes.append(note + ": the host set the pace, and another machine's CPU moves it")
    return split.ratio(src, tgt), "whole_step_roofline", notes, host_bound


def _regression_ratio(
    facts: RunFacts, src: GpuSpec, tgt: GpuSpec, method_error: float | None
) -> tuple[float, float] | None:
    """(target/source compute ratio, held-out error) from the saved ``gpulens fit`` model,
    where it did better on held-out runs than ``method_error``."""
    from gpulens.predict import fit

    model = fit.load_model()
    if model is None or (method_error is not None and model.heldout_mape_pct >= method_error):
        return None
    if not model.across_gpus or not {src.gpu, tgt.gpu} <= set(model.gpus):
        return None  # a regression says nothing about a GPU it never saw
    a, b = model.predict_s(facts, src), model.predict_s(facts, tgt)
    if a is None or b is None:
        return None
    return b / a, model.heldout_mape_pct


def _batch_core(facts: RunFacts, core_s: float, batch: int, hw: roofline.Hardware):
    """The GPU's time of a step at ``batch`` on the measured GPU, a note, and whether the GPU
    is predicted to set the pace there (its kernels and their gaps fill the step)."""
    if facts.trace is None or facts.trace_steps < 1:
        raise UsageError(
            f"run {facts.run_id} has no profiler window, which --batch-size reads: rerun it "
            "with `gpulens run WORKLOAD --torch-profiler 5`"
        )
    bs = batch_model.scale_batch(facts.trace, facts.trace_steps, facts.batch_size, batch, hw)
    fill = min(1.0, (bs.busy_s_per_step + bs.gap_s_per_step) / core_s)
    note = (
        f"batch {facts.batch_size} -> {batch}: kernels {bs.busy_s_per_step * 1e3:.2f} -> "
        f"{bs.scaled_s_per_step * 1e3:.2f} ms per step"
    )
    if bs.unknown_share > 0.05:
        note += f" ({bs.unknown_share:.0%} of it from ops without shapes, kept)"
    if fill >= GPU_BOUND_FILL:
        # the GPU set the pace: what the step holds beyond kernels (their gaps) stays
        new = core_s + bs.scaled_s_per_step - bs.busy_s_per_step
        if batch < facts.batch_size:
            if facts.host_issue_s is not None:
                # The host's launches do not shrink with the batch: the probe's time to
                # issue a step on an idle GPU is the floor the GPU's shorter step cannot go under.
                # In a GPU-paced run the host issued each step within the step, so a probe
                # longer than that (it moves from process to process) is held to the step.
                floor_s = min(facts.host_issue_s, core_s)
                if floor_s > new:
                    held = ", held to the run's step" * (floor_s < facts.host_issue_s)
                    note += (
                        f"; the host takes {floor_s * 1e3:.2f} ms to issue a step (probed after "
                        f"the measured steps{held}): it sets the pace, as a floor"
                    )
                    return floor_s, note, False
            else:
                # The profiler window cannot show the host's own time per step: under the
                # profiler the host runs 1.3-2.5x slower (H100 ladder, 2026-11-26).
                note += (
                    "; a smaller batch can leave the GPU waiting for the host, whose own time "
                    "per step this run did not probe (a run recorded by a newer gpulens "
                    "does): this prediction is then too fast"
                )
        return new, note, True
    # The host set the pace (its launches do not grow with the batch): the GPU takes over once
    # its kernels, with a gap after each, outlast the host's step.
    gpu_s = bs.scaled_s_per_step + bs.gap_s_per_step
    note += f"; the host set this run's pace (kernels and their gaps fill {fill:.0%})"
    if gpu_s < core_s:
        return core_s, note + ", kept as a floor", False
    note += (
        f"; at batch {batch} the kernels and their gaps ({gpu_s * 1e3:.2f} ms) outlast that "
        f"step ({core_s * 1e3:.2f} ms): the GPU sets the pace"
    )
    return gpu_s, note, True


def _loader_capacity(record, facts: RunFacts, loader_bound: bool) -> float | None:
    """Samples/s the run's loader could deliver with its workers: its measured pace when the
    run waited for it, else the workers' timed work (``--prep-timing``); None where unknown."""
    if loader_bound:
        return facts.batch_size / facts.step_s
    from gpulens.stalls.prep_summary import summarize_prep

    s = record.meta.get("summary") or {}
    try:
        prep = summarize_prep(
            record.dir,
            s.get("throughput_samples_per_s"),
            start_unix_s=s.get("measured_start_unix_s"),
            end_unix_s=s.get("measured_end_unix_s"),
        )
    except Exception as exc:  # no or damaged prep rows: the capacity stays unknown
        log.debug("no prep timing in %s: %s", record.dir, exc)
        return None
    return (prep or {}).get("loader_capacity_samples_per_s")


def _loader_wait(
    record,
    facts: RunFacts,
    busy_s: float,
    data_wait_s: float,
    batch: int,
    workers: int,
    loader_bound: bool,
    ranks: int = 1,
) -> tuple[float, list[str], bool]:
    """The data wait per step at ``batch``, ``workers`` a rank and ``ranks`` a host, notes, and
    whether the loader's own pace decides it without having been measured."""
    if workers != facts.workers and facts.synthetic_data:
        raise UsageError(
            f"run {facts.run_id} made its batches on the device (--data synthetic): it has no "
            "loader whose workers could be predicted; predict from a run with --data DIR"
        )
    if workers != facts.workers and facts.workers == 0:
        raise UsageError(
            f"run {facts.run_id} loaded its data in the training process (workers 0): "
            "--workers is predicted from a run with loader workers (`--workers 1` or more)"
        )
    unchanged = (batch, workers, ranks) == (facts.batch_size, facts.workers, facts.ranks_per_host)
    if facts.synthetic_data or (unchanged and not loader_bound):
        return data_wait_s, [], False
    capacity = None
    if facts.workers > 0 or loader_bound:
        capacity = _loader_capacity(record, facts, loader_bound)
    if capacity:
        # each worker prepares samples at its measured pace, as the host's probe says that
        # pace changes with the processes busy at once; the loader's step is the batch at
        # that pace times the workers
        pace, pace_notes = worker_pace_ratio(
            record.meta, facts.workers, workers, facts.ranks_per_host, ranks
        )
        loader_step = batch / (capacity * pace * workers / max(facts.workers, 1))
        if not loader_bound:
            return max(data_wait_s, loader_step - busy_s), pace_notes, False
        note = (
            f"loader-bound run: {capacity:,.0f} samples/s from {facts.workers} workers, "
            f"scaled to {workers}"
        )
        return max(0.0, loader_step - busy_s), [note, *pace_notes], False
    # The loader kept up, its own speed unknown: it still keeps up where the workers can
    # prepare at least what they did (more of them, no more ranks sharing the host's CPUs).
    pace, pace_notes = worker_pace_ratio(
        record.meta, facts.workers, workers, facts.ranks_per_host, ranks
    )
    if pace * workers < facts.workers or batch > facts.batch_size:
        note = (
            f"the loader kept up with {facts.workers} workers, its own speed is not measured "
            f"(`gpulens run ... --prep-timing`): it may not keep up at {workers} workers"
            + (f" on each of {ranks} ranks" if ranks > facts.ranks_per_host else "")
            + f" and batch {batch}"
        )
        return data_wait_s, [note, *pace_notes], True
    return data_wait_s, pace_notes, False


def _ddp_host_floor(
    facts: RunFacts, target: Target, compute_s: float, comm_s: float, same_machine: bool
) -> tuple[float, list[str], bool]:
    """The compute time of a 1-GPU run's step as N-GPU DDP on its machine, at least the host's
    pace plus DDP's own host work per step; a note where that floor binds, and whether it
    binds on the run's own machine (the host, not the GPU, paces the prediction)."""
    probe_s = facts.host_issue_s
    if target.total_gpus <= facts.gpus or facts.gpus != 1 or probe_s is None:
        return compute_s, [], False
    # The host's pace lies between its probe (ten steps on an idle GPU after the run, none of
    # the run's bookkeeping) and the run's compute time per step (the host's pace only where
    # it set it). Both move from process to process; on five H200 pairs (28 cases) the probe
    # alone left host-paced pairs 12-14% too fast, the midpoint came within 3.7% (chosen
    # there). The run issued each step within its step: a probe beyond that is held to it.
    # DDP's ranks meet at every step's all-reduce, so each step lasts as long as the slowest
    # rank's: the expected slowest of N steps drawn from the run's own steps. Without it,
    # host-paced pairs measured after the midpoint erred 11.2% run by run, all but a few too
    # fast (+7.5% on average); with it, 8.5% (+1.0%) on those 48 and 5.2% on the 16 before
    # (chosen on these 64, 2026-11-27: scaling the probe or the run's step instead did worse).
    # On a pair measured after (e893365, 100 cases): 9.7% (+0.1%), against 12.0% (+7.4%).
    slowest = facts.slowest_of_ratio(target.total_gpus)
    host_s = 0.5 * (min(probe_s, facts.compute_s) + facts.compute_s) * slowest
    ddp_s = ddp_host_issue_s(facts.workload)
    floor_s = host_s + ddp_s
    if floor_s <= compute_s + comm_s:
        return compute_s, [], False
    host = (
        f"about {host_s * 1e3:.2f} ms to issue a step (between its probe, "
        f"{probe_s * 1e3:.2f} ms, and the run's {facts.compute_s * 1e3:.2f} ms"
        if probe_s < facts.compute_s
        else f"about {host_s * 1e3:.2f} ms to issue a step (the run's step; its probe, "
        f"{probe_s * 1e3:.2f} ms, is held to it"
    )
    if slowest > 1.0:
        host += (
            f", then {slowest - 1:+.1%} as each step waits for the slowest of "
            f"{target.total_gpus} processes, by the run's step-to-step spread)"
        )
    else:
        host += ")"
    if not same_machine:  # another machine's host: its speed is not known
        note = f"this host takes {host} and DDP adds about {ddp_s * 1e3:.1f} ms: the target's "
        return compute_s, [note + "host may set the pace"], False
    note = f"the host takes {host} and DDP adds about {ddp_s * 1e3:.1f} ms to it: the host "
    return floor_s - comm_s, [note + "sets the pace"], True


def predict_run(record, target: Target, catalog: Path | None = None) -> Prediction:
    """Predict ``record`` (a RunRecord of a training run on a GPU) on ``target``."""
    facts = run_facts(record)
    src_spec = find_gpu(facts.gpu_name, catalog, recorded=True)
    tgt_spec = find_gpu(target.gpu, catalog) if target.gpu else src_spec
    column = roofline.peak_column(facts.precision, facts.workload)
    src = roofline.hardware(src_spec, column)
    tgt = roofline.hardware(tgt_spec, column)
    batch = target.batch_size or facts.batch_size
    workers = facts.workers if target.workers is None else target.workers
    multi_gpu = target.total_gpus > 1 or facts.gpus > 1
    # only an all-reduce needs the parameter count (building the model imports torch: seconds)
    params = model_size(facts.workload)[0] if multi_gpu else None
    pairs = measured_pairs(facts) if multi_gpu else []
    comm: Communication = communication(params, facts.ddp_bucket_mb, pairs, src_spec)
    comm_src = comm.exposed_s(src_spec, facts.gpus)
    core = max(facts.gpu_time_s - comm_src, 0.5 * facts.gpu_time_s)
    host = facts.compute_s - facts.gpu_time_s
    notes: list[str] = []

    loader_bound = facts.data_wait_s > LOADER_BOUND_SHARE * facts.step_s
    regimes = ["loader_bound"] * loader_bound
    if target.total_gpus != facts.gpus:
        regimes.append("multi_gpu" if src_spec.gpu != tgt_spec.gpu else "multi_gpu_same_gpu")
        regimes += ["multi_gpu_four"] * (max(target.total_gpus, facts.gpus) > 2)
    regimes += ["workers"] * (workers != facts.workers)
    fit_error = None
    same_machine = src_spec.gpu == tgt_spec.gpu
    if same_machine:
        ratio, method = 1.0, "same_gpu"
    else:
        ratio, method, notes, host_bound = _gpu_ratio(facts, core, src, tgt)
        regimes.append("host_bound" if host_bound else "gpu_bound")
        fitted = _regression_ratio(facts, src_spec, tgt_spec, validation.error_pct(method))
        if fitted is not None and batch == facts.batch_size:
            (ratio, fit_error), method = fitted, "regression"
            notes.append(f"the regression of `gpulens fit` did better on held-out runs "
                         f"({fit_error:.1f}%)")  # fmt: skip
    if batch != facts.batch_size:
        core, note, target_gpu_bound = _batch_core(facts, core, batch, src)
        notes.append(note)
        if batch > facts.batch_size:
            regimes.append("batch_up" if target_gpu_bound else "batch_up_host_bound")
        else:
            regimes.append("batch_down_probed" if facts.host_issue_s is not None else "batch_down")
    compute = host + core * ratio + facts.bookkeeping_s  # the parts add up to the step
    comm_tgt = comm.exposed_s(tgt_spec, target.gpus, target.nodes, target.network_gbps)
    if multi_gpu:
        source = (
            "calibrated on " + ", ".join(comm.calibrated_on)
            if comm.calibrated_on
            else (
                "uncalibrated: no 1- and 2-GPU runs of this workload in the store; "
                "assumes none of it overlaps the backward pass"
            )
        )
        notes.append(
            f"all-reduce of {comm.gradient_bytes / 1e6:.0f} MB gradients, exposed share "
            f"{comm.exposed_fraction:.2f} ({source})"
        )
        compute, ddp_note, host_paced = _ddp_host_floor(
            facts, target, compute, comm_tgt, same_machine
        )
        notes += ddp_note
        regimes += ["multi_gpu_host_paced"] * host_paced
    # A loader-bound run's figure is its loader's spread between sessions on another GPU; on
    # its own machine, other worker counts were validated on loader-bound runs themselves.
    same_machine_workers = same_machine and "workers" in regimes
    error = validation.error_pct(
        method, *(r for r in regimes if not (r == "loader_bound" and same_machine_workers))
    )
    repeat_note = validation.run_to_run_note(regimes)
    if fit_error is not None:
        error = max(fit_error, error or 0.0)
    # a regression's held-out error was measured on the GPUs it was fitted on
    gpus = (src_spec.gpu, tgt_spec.gpu) if fit_error is None else ()
    beyond = validation.beyond_validation(
        gpus, facts.gpus, target.gpus, target.nodes, batch / facts.batch_size, tuple(regimes)
    )
    if _is_measured_here(method, regimes):
        beyond = None  # the run's own configuration: nothing is predicted
    error, unknown = validation.claimed_error(error, beyond)
    notes += unknown
    h2d = facts.h2d_s * batch / facts.batch_size
    busy = compute + comm_tgt + h2d
    data_wait = facts.data_wait_in_step_s
    data_wait, loader_notes, loader_unknown = _loader_wait(
        record, facts, busy, data_wait, batch, workers, loader_bound, target.gpus
    )
    notes += loader_notes
    if loader_unknown:
        error = None  # the loader's own pace is what decides, and it was not measured
    if repeat_note and error is not None:
        notes.append(repeat_note)
    # the time model knows nothing of memory (a smaller batch may fit: not modelled)
    short = features.memory_shortfall(record, tgt_spec) if batch >= facts.batch_size else None
    notes = [f"{tgt_spec.gpu} {short}"] * bool(short) + notes
    step = busy + data_wait
    if not math.isfinite(step) or step <= 0:
        raise UsageError(f"run {facts.run_id} has inconsistent phase times: cannot predict")
    return Prediction(
        source_run=facts.run_id,
        target=replace(target, gpu=tgt_spec.gpu, batch_size=batch, workers=workers),
        step_time_s=step,
        throughput_samples_per_s=batch * target.total_gpus / step,
        components_s={
            "compute": compute,
            "communication": comm_tgt,
            "data": data_wait + h2d,
        },
        validated_error_pct=error,
        method=method,
        source_gpu=src_spec.gpu,
        target_gpu=tgt_spec.gpu,
        loader_bound=loader_bound,
        notes=tuple(notes),
        regimes=validation.reported_regimes(regimes),
        beyond_validation=beyond,
    )
