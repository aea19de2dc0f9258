"""Sharing one GPU between jobs: time-slice, streams, MPS and MIG (``gpulens colocate``).

Each job first runs alone on the whole GPU (its baseline: throughput, step times, peak memory,
energy). Then, per mechanism and setting, all jobs run together, started by a common clock after
every job has warmed up, for the same measured window:

- ``time-slice``: one process per job, default scheduling.
- ``streams``: one process, one thread and one CUDA stream per job; with inference and training
  mixed, a second setting gives the inference streams the highest priority.
- ``mps``: a private MPS daemon (``gpulens.launch.mps``) per setting; each setting is a
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` applied to every job, or only to the training jobs when
  inference is in the mix (``mps_limit_target``), plus an optional pinned memory limit.
- ``mig``: existing MIG instances only, one job per instance, addressed by UUID.

Numbers: ``slowdown`` = throughput alone / throughput together (1.0 = unaffected, 2.0 = half
speed); ``normalized_aggregate_throughput`` = sum over jobs of together/alone (above 1.0 the GPU
does more together than the jobs one after another); ``jain_fairness`` = Jain's index over the
per-job together/alone ratios (1.0 = all slowed alike); ``energy_vs_alone_ratio`` = GPU energy in
the window / the energy the same work took with each job alone; ``energy_per_unit_j`` (in
``energy_unit``) = GPU energy / units of all jobs, only when every job counts the same thing
(:func:`~gpulens.colocate.metrics.mechanism_energy`). A mechanism that fails is recorded with
its error; it never stops the others.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpulens.colocate.config import ColocateConfig, ProgressFn
from gpulens.colocate.device import (
    DeviceInfo,
    check_measurable,
    probe_device,
    unavailable_reason,
)
from gpulens.colocate.metrics import (
    energy_per_sample,
    job_energy,
    mechanism_energy,
    memory_fit,
    quadrature,
    slo_attainment,
    slo_fields,
    slowdown,
    summarize_result,
)
from gpulens.colocate.recommend import experiment_status, recommend
from gpulens.launch.group import GroupOutcome, Proc, run_group
from gpulens.launch.processes import (
    make_work_dir,
    remove_work_dir,
)
from gpulens.probes.window import GpuWindow
from gpulens.run.lifecycle import measured_run
from gpulens.run.result import role_name
from gpulens.workloads.jobspec import SERVING_KINDS, JobSpec

log = logging.getLogger(__name__)


HIGH_PRIORITY = -5  # torch maps it to the highest priority the device has


# --------------------------------------------------------------------------- experiment
class ColocateExperiment:
    """Runs a :class:`ColocateConfig`; ``alone_cache`` (key -> alone result) may be shared
    between experiments on the same device."""

    def __init__(
        self,
        config: ColocateConfig,
        work_dir: Path,
        progress: ProgressFn | None = None,
        alone_cache: dict[str, dict[str, Any]] | None = None,
        device_info: DeviceInfo | None = None,
        mps_factory: Callable[..., Any] | None = None,
    ):
        self.config = config
        self.work_dir = Path(work_dir)
        self.progress = progress or (lambda _msg: None)
        self.alone_cache = {} if alone_cache is None else alone_cache
        self.info = device_info
        self.mps_factory = mps_factory
        self.window: GpuWindow | None = None
        self.warnings: list[str] = []

    # --- environment per process ----------------------------------------------------------
    def _env(self, visible: str | None = None) -> dict[str, str]:
        env = dict(os.environ)
        for k in ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
            env.pop(k, None)
        env["PYTHONUNBUFFERED"] = "1"
        if self.info and self.info.cuda:
            vis = visible or self.info.uuid
            if vis:
                env["CUDA_VISIBLE_DEVICES"] = vis
        return env

    def _device(self) -> str:
        return self.info.device if self.info else "cpu"

    def _group(self, procs: list[Proc]) -> GroupOutcome:
        c = self.config
        return run_group(
            procs, self.work_dir, c.duration_s, c.warmup_s, self.window,
            setup_timeout_s=c.setup_timeout_s, command_timeout_s=c.command_timeout_s,
            cpu_threads=c.cpu_threads or (None if self.info and self.info.cuda else 1),
        )  # fmt: skip

    # --- alone ------------------------------------------------------------------------------
    def alone(self, job: JobSpec) -> dict[str, Any]:
        if job.key in self.alone_cache:
            return self.alone_cache[job.key]
        self.progress(f"{job.name} alone")
        out = self._group([Proc([job], self._env(), self._device())])
        j = next(iter(out.jobs.values()), {})
        samples = j.get("samples")
        res = {
            "throughput": j.get("throughput_samples_per_s") if not out.error else None,
            "throughput_ci95_pct": j.get("throughput_ci95_pct") if not out.error else None,
            "step_time_p50_s": j.get("step_time_p50_s"),
            "step_time_p99_s": j.get("step_time_p99_s"),
            "slo_attainment": slo_attainment(j.get("step_times_s"), job.slo_ms),
            "peak_mem_bytes": j.get("peak_mem_bytes"),
            "energy_per_unit_j": energy_per_sample(out.window.get("energy_j"), samples),
            "sm_activity_pct": out.window.get("sm_activity_pct"),
            "error": out.error,
            "error_kind": out.error_kind,
            "exit_code": j.get("exit_code"),
            "stderr_tail": j.get("stderr_tail"),
        }
        self.alone_cache[job.key] = res
        return res

    # --- together -----------------------------------------------------------------------------
    def _result(
        self, mechanism: str, setting: str, out: GroupOutcome | None, *,
        status: str | None = None, error: str | None = None, fits: bool | None = True,
        mem_needed: int | None = None, job_extra: dict[str, dict[str, Any]] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        jobs, done = [], []
        for job in self.config.jobs:
            a = self.alone_cache.get(job.key, {})
            t = (out.jobs.get(job.name) if out else None) or {}
            together = t.get("throughput_samples_per_s") if out and not out.error else None
            done.append({"unit": job.throughput_unit, "count": t.get("samples"),
                         "alone_j": a.get("energy_per_unit_j")})  # fmt: skip
            jobs.append({
                "name": job.name, "key": job.key, "kind": job.kind,
                "throughput_alone": a.get("throughput"), "throughput_together": together,
                "throughput_unit": job.throughput_unit,
                "slowdown": slowdown(a.get("throughput"), together),
                "throughput_alone_ci95_pct": a.get("throughput_ci95_pct"),
                "throughput_together_ci95_pct": t.get("throughput_ci95_pct")
                if out and not out.error else None,
                # a ratio's relative CI: the two runs' relative CIs in quadrature (first order)
                "slowdown_ci95_pct": quadrature(
                    a.get("throughput_ci95_pct"), t.get("throughput_ci95_pct")
                ),
                "step_time_p50_s": t.get("step_time_p50_s"),
                "step_time_p99_s": t.get("step_time_p99_s"),
                "step_time_p50_alone_s": a.get("step_time_p50_s"),
                "step_time_p99_alone_s": a.get("step_time_p99_s"),
                "peak_mem_bytes": t.get("peak_mem_bytes") if t.get("peak_mem_bytes") is not None
                else a.get("peak_mem_bytes"),
                "steps": t.get("steps"),
                "error": t.get("error"),
                **slo_fields(job.slo_ms, a.get("slo_attainment"),
                             slo_attainment(t.get("step_times_s"), job.slo_ms)
                             if out and not out.error else None),
                **((job_extra or {}).get(job.name, {})),
            })  # fmt: skip
        if out is not None and out.error:
            status = status or ("does_not_fit" if out.error_kind == "oom" else "failed")
            error = error or (
                f"does not fit: out of memory during the run ({out.error})"
                if out.error_kind == "oom" else out.error
            )  # fmt: skip
            if out.error_kind == "oom":
                fits = False
        window = out.window if out else {}
        result = {
            "mechanism": mechanism, "setting": setting, "status": status or "ok",
            "error": error, "fits": fits, "mem_needed_bytes": mem_needed,
            "jobs": jobs,
            "energy_j": window.get("energy_j"),
            **mechanism_energy(window.get("energy_j") if (status or "ok") == "ok" else None,
                               done, (self.window.reason if self.window else None)
                               if (status or "ok") == "ok" else "the jobs did not run together"),
            "sm_activity_pct": window.get("sm_activity_pct"),
            "gpu_util_pct": window.get("gpu_util_pct"),
            "gpu_mem_used_max_bytes": window.get("gpu_mem_used_max_bytes"),
            "window_s": window.get("window_s"),
            "process_peak_mem_bytes": out.process_peaks if out else [],
        }  # fmt: skip
        return summarize_result(result)

    def _fit(self, processes: int, total: int | None = None) -> tuple[bool | None, int | None,
                                                                      str | None]:  # fmt: skip
        if not (self.info and self.info.cuda):
            return True, None, None
        peaks = [self.alone_cache.get(j.key, {}).get("peak_mem_bytes")
                 for j in self.config.jobs if j.builtin]  # fmt: skip
        return memory_fit(peaks, total or self.info.memory_total_bytes, processes)

    def _unavailable(self, mechanism: str, setting: str, why: str) -> dict[str, Any]:
        return self._result(mechanism, setting, None, status="unavailable", error=why, fits=None)

    def _run_checked(self, mechanism: str, setting: str, procs: list[Proc], *,
                     n_contexts: int, extra=None) -> dict[str, Any]:  # fmt: skip
        fits, needed, why = self._fit(n_contexts)
        if fits is False:
            return self._result(mechanism, setting, None, status="does_not_fit", error=why,
                                fits=False, mem_needed=needed)  # fmt: skip
        self.progress(f"{mechanism} {setting}")
        try:
            out = self._group(procs)
        except Exception as exc:  # a broken mechanism must not stop the experiment
            log.exception("%s %s failed", mechanism, setting)
            return self._result(mechanism, setting, None, status="failed",
                                error=f"{type(exc).__name__}: {exc}", fits=fits)  # fmt: skip
        return self._result(mechanism, setting, out, fits=fits, mem_needed=needed,
                            job_extra=extra)  # fmt: skip

    def _why_unavailable(self, mechanism: str) -> str | None:
        info = self.info or DeviceInfo("cpu")
        return unavailable_reason(mechanism, info, self.config.jobs,
                                  check_mps=self.mps_factory is None)  # fmt: skip

    def _mixed(self) -> bool:
        kinds = {j.kind for j in self.config.jobs}
        return bool(kinds & set(SERVING_KINDS)) and ("train" in kinds or "cmd" in kinds)

    def time_slice(self) -> list[dict[str, Any]]:
        procs = [Proc([j], self._env(), self._device()) for j in self.config.jobs]
        return [self._run_checked("time-slice", "default", procs, n_contexts=len(procs))]

    def streams(self) -> list[dict[str, Any]]:
        c = self.config
        why = self._why_unavailable("streams")
        if why:
            return [self._unavailable("streams", "default", why)]
        settings = [("default", [None] * len(c.jobs))]
        if c.stream_priorities and self._mixed():
            prios = [HIGH_PRIORITY if j.kind == "infer" else 0 for j in c.jobs]
            settings.append(("inference high priority", prios))
        out = []
        for setting, prios in settings:
            extra = {j.name: {"stream_priority": p} for j, p in zip(c.jobs, prios, strict=True)}
            out.append(self._run_checked(
                "streams", setting, [Proc(list(c.jobs), self._env(), self._device(), prios)],
                n_contexts=1, extra=extra,
            ))  # fmt: skip
        return out

    def mps(self) -> list[dict[str, Any]]:
        from gpulens.launch.mps import PrivateMps

        c = self.config
        target = c.mps_limit_target
        if target == "auto":
            target = "train" if self._mixed() else "all"
        settings = [f"thread_pct={p:g}" + (" (training jobs)" if target == "train" else "")
                    for p in c.mps_thread_pcts]  # fmt: skip
        why = self._why_unavailable("mps")
        if why:
            return [self._unavailable("mps", s, why) for s in settings]
        factory = self.mps_factory or PrivateMps
        results = []
        for pct, setting in zip(c.mps_thread_pcts, settings, strict=True):
            fits, needed, why = self._fit(len(c.jobs))
            if fits is False:
                results.append(self._result("mps", setting, None, status="does_not_fit",
                                            error=why, fits=False, mem_needed=needed))  # fmt: skip
                continue
            self.progress(f"mps {setting}")
            try:
                with factory(gpu_uuid=self.info.uuid) as daemon:
                    procs, extra = [], {}
                    for j in c.jobs:
                        limited = target == "all" or j.kind not in SERVING_KINDS
                        env = daemon.client_env(pct if limited else None, c.mps_mem_limit)
                        env["PYTHONUNBUFFERED"] = "1"
                        procs.append(Proc([j], env, "cuda:0"))
                        extra[j.name] = {"mps_thread_pct": pct if limited else 100.0}
                    out = self._group(procs)
                results.append(self._result("mps", setting, out, fits=fits, mem_needed=needed,
                                            job_extra=extra))  # fmt: skip
            except Exception as exc:
                log.warning("mps %s failed: %s", setting, exc)
                results.append(
                    self._result(
                        "mps",
                        setting,
                        None,
                        status="failed",
                        error=f"{type(exc).__name__}: {exc}",
                        fits=fits,
                    )
                )
        return results

    def mig(self) -> list[dict[str, Any]]:
        from gpulens.probes.nvml.mig import mig_layout

        why = self._why_unavailable("mig")
        if why:
            return [self._unavailable("mig", "existing instances", why)]
        layout = mig_layout(self.info.nvml_index)
        jobs = self.config.jobs
        procs, extra = [], {}
        for j, inst in zip(jobs, layout.instances, strict=False):
            peak = self.alone_cache.get(j.key, {}).get("peak_mem_bytes")
            fits, needed, why = memory_fit([peak], inst.memory_total_bytes, 1)
            if fits is False:
                return [
                    self._result(
                        "mig",
                        "existing instances",
                        None,
                        status="does_not_fit",
                        error=f"{j.name} on {inst.uuid}: {why}",
                        fits=False,
                    )
                ]
            procs.append(Proc([j], self._env(visible=inst.uuid), "cuda:0"))
            extra[j.name] = {"mig_uuid": inst.uuid}
        self.progress("mig")
        out = self._group(procs)
        return [self._result("mig", "existing instances", out, fits=True, job_extra=extra)]

    # --- all ------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        c = self.config
        if self.info is None:
            self.progress("probing the device")
            self.info = probe_device(c.device)
        # before any job runs alone: refuse at once when no mechanism asked for can run here
        check_measurable({m: self._why_unavailable(m) for m in c.mechanisms}, self.info)
        if self.info.cuda:
            from gpulens.launch.mps import find_foreign_daemons, foreign_daemon_message

            foreign = find_foreign_daemons()
            if foreign:
                self.warnings.append(
                    foreign_daemon_message(foreign) + "; processes of the non-MPS mechanisms may "
                    "become its clients"
                )
        self.window = GpuWindow(self.info.nvml_index if self.info.cuda else None)
        try:
            for job in c.jobs:
                self.alone(job)
            alone_failed = [j for j in c.jobs if self.alone_cache[j.key]["error"]]
            results: list[dict[str, Any]] = []
            for mech in c.mechanisms:
                if alone_failed:
                    j = alone_failed[0]
                    a = self.alone_cache[j.key]
                    why = (
                        f"does not fit: {j.name} runs out of memory alone"
                        if a["error_kind"] == "oom"
                        else f"{j.name} failed alone: {a['error']}"
                    )
                    st = "does_not_fit" if a["error_kind"] == "oom" else "failed"
                    results.append(
                        self._result(
                            mech,
                            "-",
                            None,
                            status=st,
                            error=why,
                            fits=False if st == "does_not_fit" else None,
                        )
                    )
                    continue
                try:
                    results += getattr(self, mech.replace("-", "_"))()
                except Exception as exc:  # never let one mechanism end the experiment
                    log.exception("mechanism %s failed", mech)
                    results.append(
                        self._result(
                            mech,
                            "-",
                            None,
                            status="failed",
                            error=f"{type(exc).__name__}: {exc}",
                            fits=None,
                        )
                    )
        finally:
            self.window.close()
        doc = {
            "gpu": self.info.as_dict(),
            "device": "cpu" if not self.info.cuda else self.info.device,
            "jobs": [self._job_doc(j) for j in c.jobs],
            "results": results,
            "recommendation": "",
            "warnings": self.warnings,
            "duration_s": c.duration_s,
            "warmup_s": c.warmup_s,
            "max_slowdown": c.max_slowdown,
        }
        doc["recommendation"] = recommend(doc, c.max_slowdown)
        doc["status"], doc["error"] = experiment_status(doc)
        return doc

    def _job_doc(self, job: JobSpec) -> dict[str, Any]:
        a = self.alone_cache.get(job.key, {})
        return {
            **job.to_dict(),
            "throughput_alone": a.get("throughput"),
            "throughput_unit": job.throughput_unit,
            "throughput_alone_ci95_pct": a.get("throughput_ci95_pct"),
            "step_time_p50_alone_s": a.get("step_time_p50_s"),
            "step_time_p99_alone_s": a.get("step_time_p99_s"),
            "peak_mem_bytes": a.get("peak_mem_bytes"),
            **job_energy(a.get("energy_per_unit_j"), job.throughput_unit),
            "sm_activity_alone_pct": a.get("sm_activity_pct"),
            "error": a.get("error"),
            "exit_code": a.get("exit_code"),
            "stderr_tail": a.get("stderr_tail"),
        }


def run_colocate(
    config: ColocateConfig,
    runs_root: Path | None,
    progress: ProgressFn | None = None,
    alone_cache: dict[str, dict[str, Any]] | None = None,
    device_info: DeviceInfo | None = None,
) -> dict[str, Any]:
    """Run the experiment; with ``runs_root`` it is stored as a run record of kind
    ``colocate`` (the summary holds the result document, which ``--plan`` reads back)."""
    if runs_root is None:
        return _run_in(config, progress, alone_cache, device_info)
    # The record first (status running, the requested config); the environment, which imports
    # torch and initialises NVML, after it; every exit path ends it (measured_run).
    with measured_run(
        runs_root,
        kind="colocate",
        name=config.name or "colocate-" + "+".join(j.name for j in config.jobs),
        requested_config=config.as_dict(),
        role=role_name("colocate", "experiment"),
    ) as run:
        doc = _run_in(config, progress, alone_cache, device_info)
        doc["run_id"] = run.run_id
        doc["record_dir"] = str(run.dir)
        run.set_effective(config.as_dict())
        run.set_summary({"colocate": _strip(doc)})
        if doc["status"] != "finished":
            run.end_as(doc["status"], doc.get("error"))
    return doc


def _run_in(
    config: ColocateConfig,
    progress: ProgressFn | None,
    alone_cache: dict[str, dict[str, Any]] | None,
    device_info: DeviceInfo | None,
) -> dict[str, Any]:
    work = make_work_dir("gpulens-colocate-")
    try:
        return ColocateExperiment(config, work, progress, alone_cache, device_info).run()
    finally:
        remove_work_dir(work)


def _strip(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in ("run_id", "record_dir")}
