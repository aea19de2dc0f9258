"""Data-parallel training (DDP) over several GPUs of one host, one process per GPU.

The parent process owns the run record and the monitor (every GPU of the run, and the host
with the whole process tree); it spawns one training process per GPU. Every rank times its
steps and sends them back once, when the run has ended (rank 0 also sends its progress); all
ranks agree on when to stop (rank 0 decides), so the measured window is the same everywhere.
The record keeps every rank's steps and names the stragglers (see
:mod:`gpulens.workloads.host_ranks`). Communication overlaps computation as DDP does it
by default (gradient buckets all-reduced during the backward pass).

On a CPU-only machine ``--gpus N --device cpu`` runs N processes over gloo: the same code path,
so it can be tested anywhere.

Over several nodes (``config.nodes``) each node's gpulens runs this for its own ``--gpus N``
processes, ranked globally; the ranks meet through the store node 0's launcher serves, and each
node writes its own record shard (see :mod:`gpulens.workloads.nodes`).
"""

from __future__ import annotations

import logging
import os
import queue as queue_mod
import re
import signal
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gpulens.data.bad_samples import SKIPPED_SAMPLES_FILE
from gpulens.errors import GpulensError, RuntimeFailure, UsageError
from gpulens.launch.processes import on_lasting_thread, set_parent_death_signal
from gpulens.probes.monitor import ProbeSpec
from gpulens.probes.steps import StepTimer
from gpulens.record.schema import STEPS_SCHEMA
from gpulens.run import RunResult, RunSession, measured_run
from gpulens.workloads.config import EffectiveTrainConfig, resolve_config
from gpulens.workloads.devices import nvml_index_for
from gpulens.workloads.host_ranks import rank_summary, slowed, write_steps
from gpulens.workloads.loop import LoopResult, StopControl, measured_loop
from gpulens.workloads.models import WorkloadSpec, get_workload
from gpulens.workloads.recipe import oom_message, prepare, require_one_batch
from gpulens.workloads.run_summary import summarize_run

log = logging.getLogger(__name__)

# NCCL's socket transport only: no peer-to-peer (NVLink, PCIe), no shared memory, no
# InfiniBand. Between processes of one host this is the closest to a network between hosts.
SOCKET_TRANSPORT_ENV = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_NET": "Socket",
}
NCCL_LOG_PREFIX = "nccl-"
_VIA = re.compile(r"via ((?:P2P|SHM|NET|CollNet|NVLS)[^\s]*)")


def transport_env(transport: str) -> dict[str, str]:
    """Environment variables that select ``transport`` ("default" changes nothing)."""
    return dict(SOCKET_TRANSPORT_ENV) if transport == "socket" else {}


def parse_nccl_transports(log_text: str) -> list[str]:
    """The transports NCCL reported for its channels ("P2P/CUMEM", "NET/Socket", "SHM/direct"),
    read from its INFO log lines such as ``Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read``."""
    found = set()
    for match in _VIA.finditer(log_text):
        found.add("/".join(match.group(1).split("/")[:2]))
    return sorted(found)


def read_nccl_transports(record_dir: Path) -> list[str] | None:
    texts = []
    for path in sorted(Path(record_dir).glob(f"{NCCL_LOG_PREFIX}*.log")):
        try:
            texts.append(path.read_text(errors="replace"))
        except OSError:
            continue
    return parse_nccl_transports("\n".join(texts)) if texts else None


LOOPBACK = "127.0.0.1"
STORE_TIMEOUT_S = 600.0


def loopback_interface() -> str | None:
    """The name of the interface that holds 127.0.0.1 ("lo" on Linux), None if none does."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addrs):
            return name
    return None


def loopback_env() -> dict[str, str]:
    """Socket interfaces for gloo and NCCL on one host: the loopback, unless the user chose."""
    iface = loopback_interface()
    if iface is None:
        return {}
    return {k: iface for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k not in os.environ}


def init_group(
    backend: str,
    rank: int,
    world: int,
    port: int,
    device_id=None,
    addr: str = LOOPBACK,
    prefix: str | None = None,
):
    """Join a process group whose rendezvous store listens on the loopback only.

    PyTorch's own TCPStore server listens on every interface (``::``) whatever MASTER_ADDR
    says; here rank 0 binds the listening socket to 127.0.0.1 itself and hands it over. The
    ranks' own sockets (gloo, NCCL bootstrap) use the loopback through :func:`loopback_env`.
    With ``prefix`` (a multi-node run) a node's launcher serves the store at ``addr``: every
    rank connects to it and keeps its keys under ``prefix``."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
    if prefix is not None:
        store = dist.TCPStore(addr, port, None, False, timeout)
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore(prefix, store),
            rank=rank,
            world_size=world,
            device_id=device_id,
        )
        return store
    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((LOOPBACK, port))
        listener.listen(max(128, 2 * world))
        store = dist.TCPStore(
            LOOPBACK, port, world, True, timeout, master_listen_fd=listener.detach()
        )
    else:
        store = dist.TCPStore(LOOPBACK, port, world, False, timeout)
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world, device_id=device_id
    )
    return store


def free_port() -> int:
    """A TCP port free on the loopback now, for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_devices(config, world: int) -> str:
    """The device type the processes use; a usage error when the GPUs are not there."""
    requested = (config.device or "").strip().lower()
    if requested == "cpu":
        return "cpu"
    if requested not in ("", "cuda"):
        raise UsageError(
            f"--gpus {world} uses cuda:0..cuda:{world - 1} (one process each): leave out "
            "--device, or pick GPUs with CUDA_VISIBLE_DEVICES"
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0 and not requested:
        raise UsageError(
            f"--gpus {world} needs {world} CUDA GPUs and none is visible here (see `gpulens "
            f"doctor`); use --device cpu to run {world} processes on the CPU instead"
        )
    if count < world:
        raise UsageError(
            f"--gpus {world} needs {world} GPUs but this machine has {count}: use --gpus {count}"
        )
    return "cuda"


@dataclass(frozen=True)
class GroupPlan:
    """Where a run's training processes meet, and which global ranks are this node's."""

    world: int  # processes of the whole run (every node)
    port: int
    addr: str = LOOPBACK
    rank_offset: int = 0  # the global rank of this node's local rank 0
    # A store a node's launcher serves (multi-node: keys under this prefix); None: rank 0
    # serves one on the loopback.
    prefix: str | None = None


def run_distributed(
    config,
    spec: WorkloadSpec,
    runs_root: Path,
    progress,
    kind: str,
    role: str | None = None,
    metrics=None,
) -> RunResult:
    """``run_training`` for ``config.gpus`` > 1 processes, or for this node's processes of a
    run over several nodes (``config.nodes``: see :mod:`gpulens.workloads.nodes`)."""
    local = config.gpus
    nodes = config.nodes
    world = local * (nodes.nnodes if nodes else 1)
    device_type = _check_devices(config, local)
    device0 = torch.device("cuda:0" if device_type == "cuda" else "cpu")
    env = transport_env(config.nccl_transport) if device_type == "cuda" else {}
    eff = resolve_config(config, spec, device0).with_built(
        device=f"{device_type}:0..{local - 1}" if device_type == "cuda" else "cpu",
        backend="nccl" if device_type == "cuda" else "gloo",
        transport_env=env,
        rendezvous_addr=nodes.master_addr if nodes else LOOPBACK,
        nodes=nodes.as_dict() if nodes else None,
    )
    name = config.name or f"{spec.name}-{world}x{device_type}-b{eff.batch_size}"
    if eff.data != "synthetic":  # the ranks would find bad data only once the run measures
        from gpulens.data.datasets import build_dataset

        require_one_batch(eff, len(build_dataset(spec, eff.data, n_synthetic=0)), world)
    shard = None
    if nodes is not None:
        from gpulens.workloads.nodes import NodeShard

        shard = NodeShard.open(nodes, eff, runs_root, kind, name, asdict(config), role)
        plan = shard.plan
        env = {**env, **shard.network_env}
    else:
        plan = GroupPlan(world=world, port=free_port())
    try:
        with measured_run(
            runs_root,
            kind=kind,
            name=name,
            requested_config=asdict(config),
            role=role,
            metrics=metrics,
            writer=shard.writer if shard else None,
        ) as run:
            run.oom_hint = oom_message(eff.batch_size, device0)
            if device_type == "cuda" and "NCCL_DEBUG" not in os.environ:
                # NCCL says which transport each channel took: the effective setting, logged.
                env = {
                    **env,
                    "NCCL_DEBUG": "INFO",
                    "NCCL_DEBUG_SUBSYS": "INIT",
                    "NCCL_DEBUG_FILE": str(run.dir / f"{NCCL_LOG_PREFIX}%p.log"),
                }
            nvml_indices = []
            if device_type == "cuda":
                nvml_indices = [nvml_index_for(torch.device(f"cuda:{i}")) for i in range(local)]
            probes = [ProbeSpec("host", {"root_pid": os.getpid()})]
            if nvml_indices:
                probes.insert(0, ProbeSpec("gpu", {"indices": nvml_indices}))
            else:
                run.mark_unsupported("gpu", "the run used the CPU")
            _spawn_and_summarize(
                spec, eff, local, device0, run, probes, nvml_indices, env, progress, plan
            )
    except BaseException as exc:
        if shard is not None:
            shard.failed(exc)
        raise
    result = run.result()
    return shard.end(result) if shard is not None else result


def _spawn_and_summarize(
    spec, eff, local, device0, run: RunSession, probes, nvml_indices, env, progress, plan
):
    import torch.multiprocessing as mp

    writer = run.writer
    run.set_effective(eff.as_dict())
    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    result: dict[str, Any] | None = None
    peaks: dict[int, int | None] = {}
    rank_steps: dict[int, tuple[list[dict[str, Any]], float]] = {}
    error: str | None = None
    error_exit_code = 1  # a rank's gpulens error keeps its exit code (2: bad input)

    def drain() -> None:
        nonlocal result, error, error_exit_code
        while True:
            try:
                msg = messages.get_nowait()
            except queue_mod.Empty:
                return
            if msg[0] == "progress" and progress is not None:
                progress(*msg[1:], {})
            elif msg[0] == "peak":
                peaks[msg[1]] = msg[2]
            elif msg[0] == "rows":
                rank_steps[msg[1]] = (msg[2], msg[3])
            elif msg[0] == "result":  # with local rank 0's steps
                result = msg[1]
                rank_steps[plan.rank_offset] = (result["rows"], result["loop"]["wall_measured_s"])
            elif msg[0] == "error" and error is None:
                error = msg[1]
                error_exit_code = msg[2] if len(msg) > 2 else 1

    def waiting() -> bool:
        return result is None or len(peaks) < local or len(rank_steps) < local

    with run.monitor(probes, hz=eff.sample_hz):
        # Forked from a thread that lives as long as this process: each rank's parent-death
        # signal (armed in _rank_main) fires when this process dies, not when a thread ends.
        procs = on_lasting_thread(
            lambda: mp.start_processes(
                _rank_main,
                args=(local, eff, str(writer.dir), plan, messages, env, os.getpid()),
                nprocs=local,
                join=False,
                start_method="spawn",
            )
        )
        try:
            while not procs.join(timeout=0.25):
                drain()
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            time.sleep(0.2)
            drain()
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            failure = UsageError if error and error_exit_code == 2 else RuntimeFailure
            raise failure(error or f"a training process failed: {last}") from None
        except BaseException:
            for p in procs.processes:
                if p.is_alive():
                    p.terminate()
            raise
        # Results may still sit in the queue's pipe after the processes have exited.
        deadline = time.monotonic() + 5.0
        while waiting() and time.monotonic() < deadline:
            drain()
            time.sleep(0.05)
    if result is None:
        raise RuntimeFailure(error or "the training processes ended without a result")
    if plan.prefix is None:  # one host: every rank's steps in the run's steps series
        write_steps(writer, rank_steps, eff.batch_size)
    else:  # a node's shard: its local rank 0's here, each rank's apart (record_ranks)
        series = writer.series("steps", STEPS_SCHEMA)
        for row in result["rows"]:
            series.append(row)
        series.close()
    transports = read_nccl_transports(writer.dir) if eff.backend == "nccl" else ["gloo"]
    # Rank 0 built the optimizer and read the dataset: what it learnt joins the config.
    eff = eff.with_built(**result.get("built", {}), transport_effective=tuple(transports))
    if eff.nccl_transport == "socket" and transports and "NET/Socket" not in transports:
        log.warning("NCCL was asked for sockets but reported %s", ", ".join(transports))
    measured = [r for r in result["rows"] if not r["warmup"]]
    # Rank 0's time in gpulens's step timer per step, on its training thread.
    costs = {
        **run.monitor_costs(),
        "tracking_us_per_step": result.get("tracking_us_per_step"),
        "gpu_timing_every_n_steps": result.get("gpu_timing_every_n_steps"),
    }
    peak_mem_bytes = [peaks.get(r) for r in range(local)]
    loop = LoopResult(**result["loop"])
    summary = summarize_run(
        spec, eff, device0, writer, measured, costs, loop, nvml_indices, peak_mem_bytes, local
    )
    if plan.prefix is None:
        extra = rank_summary(rank_steps, plan.world, eff.batch_size)
        writer.update(summary=extra)
        return {**summary, **extra}
    from gpulens.workloads.nodes import record_ranks

    return record_ranks(writer, plan, eff, rank_steps, summary)


def _rank_main(
    local_rank: int,
    local_world: int,
    eff: EffectiveTrainConfig,
    record_dir: str,
    plan: GroupPlan,
    messages,
    env: dict[str, str],
    parent_pid: int | None = None,
) -> None:
    """One training process (spawned): joins the group, trains, reports to the parent. It dies
    with the parent (SIGKILL when the parent dies, even by SIGKILL)."""
    set_parent_death_signal(signal.SIGKILL, parent_pid)
    import torch.distributed as dist

    rank, world = plan.rank_offset + local_rank, plan.world
    os.environ.update(env)
    if plan.prefix is None:
        os.environ.update(loopback_env())
    os.environ.update(MASTER_ADDR=plan.addr, MASTER_PORT=str(plan.port))
    cuda = eff.backend == "nccl"
    device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    torch.manual_seed(eff.seed)
    spec = get_workload(eff.workload)
    init_group(
        eff.backend, rank, world, plan.port, device if cuda else None, plan.addr, plan.prefix
    )
    try:
        control = StopControl(dist.new_group(backend="gloo"))
        timing_dir = Path(record_dir) / "series" if eff.prep_timing and local_rank == 0 else None
        skip_log = Path(record_dir) / SKIPPED_SAMPLES_FILE
        try:
            prepared = prepare(
                spec, eff, device, timing_dir, rank, world, skip_log=skip_log, local_rank=local_rank
            )
            prepared = slowed(prepared, rank)  # a test's slow rank (GPULENS_TEST_SLOW_RANK)
        except GpulensError as exc:
            messages.put(("error", str(exc), exc.exit_code))
            raise
        timer = StepTimer(None, cuda=cuda, warmup_steps=0)
        last_sent = [0.0]

        def report(step, total, elapsed_s, _info) -> None:
            now = time.monotonic()
            # at most two a second, and the last step always (the bar ends at n/n)
            if local_rank == 0 and (now - last_sent[0] >= 0.5 or step == total):
                messages.put(("progress", step, total, elapsed_s))
                last_sent[0] = now

        try:
            loop = measured_loop(
                prepared, prepared.effective, device, timer, report, eff.batch_size * world, control
            )
        except torch.cuda.OutOfMemoryError:
            messages.put(("error", oom_message(eff.batch_size, device)))
            raise
        except GpulensError as exc:  # e.g. a bad image, named by the loader
            messages.put(("error", str(exc), exc.exit_code))
            raise
        timer.finish()
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        messages.put(("peak", local_rank, peak))
        if local_rank != 0:  # local rank 0's steps travel with the result
            messages.put(("rows", rank, timer.rows, loop.wall_measured_s))
        else:
            messages.put(
                (
                    "result",
                    {
                        "rows": timer.rows,
                        "loop": asdict(loop),
                        "tracking_us_per_step": timer.tracking_us_per_step(),
                        "gpu_timing_every_n_steps": timer.gpu_timing_every_n_steps,
                        "built": _built_facts(prepared.effective),
                    },
                )
            )
        control.barrier()
    finally:
        dist.destroy_process_group()


def _built_facts(eff: EffectiveTrainConfig) -> dict[str, Any]:
    """What a rank learnt while building (the optimizer, the dataset), to send to the parent."""
    rank_facts = ("optimizer", "dataset", "paired_cold_samples", "paired_cold_max_steps")
    return {name: getattr(eff, name) for name in rank_facts if getattr(eff, name) is not None}
