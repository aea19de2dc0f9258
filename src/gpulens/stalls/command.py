"""Stall breakdown of a user's own training script: ``gpulens stalls --data PATH -- CMD``.

The script is unmodified (its DataLoader and optimizer steps are timed by injection,
:mod:`gpulens.workloads.inject`) or uses the tracking API (``with gpulens.track() as t: for b
in t.data(loader): ...``); it runs three times under the monitor, each a stored run of kind
``stalls``:

- ``ingestion_free``: ``GPULENS_INGESTION_FREE=1`` makes ``tracker.data()`` repeat the loader's
  first batches (moved to the device given to ``data(..., device=)``) instead of loading more;
- ``cached``: after every file under PATH was read once, so it sits in the page cache;
- ``cold``: after the files were evicted from the page cache; ``GPULENS_FIRST_PASS_ONLY=1``
  makes the tracker time only the first pass over the loader, the one that reads each file once.
  Where no eviction works, there is no cold run and the notes say why: a warm read is never
  reported as cold.

Throughput and its CI come from the tracker's summary of each run; the runs are made, and the
books kept, by :class:`~gpulens.stalls.runner.StallRunner` with its command backend, as for a
built-in workload. Interconnect and network stalls need runs gpulens launches itself and are
null here.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from gpulens.errors import RuntimeFailure, UsageError
from gpulens.launch.processes import check_command
from gpulens.run.result import RunResult
from gpulens.stalls.config import ProgressFn, StallResult
from gpulens.stalls.model import measure_run
from gpulens.stalls.runner import CommandBackend, StallRunner, warm_page_cache
from gpulens.workloads.tracking import INGESTION_FREE_ENV

NO_STEPS = (
    "no steps were seen: the script must iterate a torch.utils.data.DataLoader and call a "
    "torch.optim optimizer's step() (then they are timed with no change to it), or wrap its "
    "loader in gpulens.track().data(...)"
)
MIN_COLD_STEPS = 3  # measured steps of the first pass below which no fetch stall is given


def _data_files(path: Path) -> list[Path]:
    """Every file at ``path`` (a file, or a folder searched recursively, hidden ones left out)."""
    if path.is_file():
        return [path]
    files = []
    for dirpath, dirnames, names in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files.extend(Path(dirpath) / n for n in sorted(names) if not n.startswith("."))
    return files


def _label(argv: list[str]) -> str:
    """A short name for the runs: the script's name where there is one."""
    for arg in argv:
        if arg.endswith(".py"):
            return Path(arg).stem
    return Path(argv[0]).name


def _check_steps(r: RunResult, kind: str) -> None:
    s = r.summary
    if not s.get("steps_total") and not s.get("measured_steps"):
        raise UsageError(
            f"{NO_STEPS} (see examples/train_tracked.py); the {kind} run {r.run_id} has no steps"
        )
    if not s.get("measured_steps") or not s.get("throughput_samples_per_s"):
        raise UsageError(
            f"the script reported {s.get('steps_total')} steps, all of them warm-up: let it run "
            f"at least 10 more steps (more epochs or steps); the {kind} run is {r.run_id}"
        )


def run_stalls_command(
    argv: list[str],
    data: str,
    runs_root: Path,
    progress: ProgressFn | None = None,
    sample_hz: float = 10.0,
) -> StallResult:
    """Run ``argv`` ingestion-free, with PATH cached and with PATH cold (all stored), and break
    its time per sample into compute, prep stall and fetch stall."""
    from gpulens.data import pagecache

    if not argv:
        raise UsageError("no command given: gpulens stalls --data PATH -- python train.py ...")
    check_command(argv)  # before the dataset is looked at, and before any run
    if str(data) == "synthetic":
        raise UsageError(
            "the stall breakdown needs the on-disk dataset the script reads: give --data PATH"
        )
    data_path = Path(data).expanduser().resolve()
    if not data_path.exists():
        raise UsageError(
            f"dataset path {data} does not exist: give the folder (or file) the script reads"
        )
    files = _data_files(data_path)
    sizes = [f.stat().st_size for f in files if f.is_file()]
    if not sizes:
        raise UsageError(f"no files under {data_path}: give the folder the script reads")
    result = StallResult(workload=shlex.join(argv), device=None)  # type: ignore[arg-type]
    backend = CommandBackend(argv, _label(argv), data_path, runs_root, sample_hz)
    runner = StallRunner(backend, result, progress)
    say, run = runner.say, runner.run

    free = run("ingestion_free", ingestion_free=True)
    _check_steps(free, "ingestion_free")
    loader = free.summary.get("loader") or {}
    if not loader.get("ingestion_free"):
        raise RuntimeFailure(
            f"the ingestion-free run did not take effect: the script's tracker did not see "
            f"{INGESTION_FREE_ENV}=1 (does the script clear its environment?); its record is "
            f"{free.record_dir}"
        )
    result.device = loader.get("device")
    if result.device is None and loader.get("injected"):
        result.notes.append(
            "steps injected (the script has no gpulens in it): the ingestion-free run replays "
            "the loader's first batches as the loader made them, so on a GPU 'compute' "
            "includes the script's own host-to-device copy"
        )
    elif result.device is None:
        result.notes.append(
            "tracker.data() got no device=: the ingestion-free batches stayed where the loader "
            "put them, so on a GPU 'compute' includes the script's own host-to-device copy; "
            "pass device= (e.g. tracker.data(loader, device='cuda')) for synthetic batches "
            "already on the GPU"
        )

    say("warming the page cache")
    warm_page_cache(files, result.notes)
    cached = run("cached")
    _check_steps(cached, "cached")
    cached_loader = cached.summary.get("loader") or {}

    say("evicting the dataset from the page cache")
    cold: RunResult | None = None
    evicted = pagecache.evict(files)
    if evicted.method is None:
        result.notes.append(f"fetch stall not measured: {evicted.note}")
        runner.unmeasured("cold", keep_run=False)
    else:
        result.fetch_method = evicted.method
        cold = run("cold", first_pass=True)
        s = cold.summary
        if (s.get("measured_steps") or 0) < MIN_COLD_STEPS or not s.get("throughput_samples_per_s"):
            result.notes.append(
                f"fetch stall not measured: the first pass over the loader had "
                f"{s.get('measured_steps') or 0} steps after the tracker's warm-up, fewer than "
                f"{MIN_COLD_STEPS}; give a larger dataset (the cold run {cold.run_id} is stored)"
            )
            runner.unmeasured("cold")
            cold = None
        else:
            result.notes.append(
                f"cold run: {evicted.method} left {100 * (evicted.resident_after or 0):.1f}% of "
                "the data cached; only the first pass over the loader is timed (each file read "
                "once)"
            )
            cold_loader = s.get("loader") or {}
            if not cold_loader.get("passes_completed") and (s.get("samples_total") or 0) > len(
                files
            ):
                result.notes.append(
                    f"the cold run's loader never ended a pass and the script read "
                    f"{s['samples_total']} samples from {len(files)} files: some reads may have "
                    "been warm, so the fetch stall may be low"
                )

    runner.fill_missing()
    result.notes.append(
        "interconnect and network stalls not measured for a command: they need N-GPU runs "
        "that gpulens launches itself (gpulens stalls WORKLOAD --gpus N)"
    )

    m_free, m_cached = measure_run(free), measure_run(cached)
    m_cold = measure_run(cold)
    runner.set_breakdown({"ingestion_free": m_free, "cached": m_cached, "cold": m_cold})
    result.fetch_design = "separate" if m_cold is not None else None  # a script: no paired run
    if m_free.per_sample_s > m_cached.per_sample_s + m_cached.half_width_s + m_free.half_width_s:
        result.notes.append(
            "the ingestion-free run was slower than the cached run: the prep stall is shown as "
            "0; the script may do per-batch work that does not depend on the loader"
        )

    phases = cached.summary.get("phases_s") or {}
    step_s, wait_s = phases.get("step"), phases.get("data_wait")
    wait_pct = 100.0 * wait_s / step_s if step_s and wait_s is not None else None
    result.single_run_estimate_pct = {
        "data_wait": wait_pct,
        "prep_stages": None,
        "workers_starved": None,
        "explanation": "a script's loader is timed as a whole: per-stage prep timing (read, "
        "decode, augment, collate) and worker starvation need a built-in workload",
        "from_run": cached.run_id,
    }

    workers = cached_loader.get("num_workers")
    if workers == 0:
        result.notes.append(
            "the DataLoader has num_workers=0 (loading inside the training loop): the what-if "
            "counts the cached run's whole time per sample as loading time, so its gains from "
            "more workers are a lower bound"
        )
    return runner.finish(m_free, m_cached, m_cold, workers, sum(sizes) / len(sizes), None)
