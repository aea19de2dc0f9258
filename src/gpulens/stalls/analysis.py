"""A stall breakdown recomputed from stored runs (Holistic Trace Analysis's shape: load once,
analyse with stateless functions). Runs are grouped by their stored role (``stalls:cached``...);
records made before roles were stored get the role their name implies, so a paired cold run is
never pooled as a plain cold one."""

from __future__ import annotations

import tarfile
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpulens.run.result import RunResult
from gpulens.stalls.model import PAIRED_KIND, Measured, breakdown_of, pooled, pooled_paired


@dataclass(frozen=True)
class StallAnalysis:
    """Stored stall runs by role (``ingestion_free``, ``cached``, ``cold``, ``paired_cold``,
    ``multi_gpu``, ``multi_gpu_socket``)."""

    runs: dict[str, list[RunResult]] = field(default_factory=dict)

    @classmethod
    def from_results(cls, results: Iterable[RunResult]) -> StallAnalysis:
        by_role: dict[str, list[RunResult]] = {}
        for r in results:
            if r.role and r.role.startswith("stalls:") and r.status == "finished":
                role = r.experiment_role or ""
                if role == PAIRED_KIND and not r.summary.get("paired_fetch"):
                    r = _with_paired_fetch(r)
                by_role.setdefault(role, []).append(r)
        return cls(by_role)

    @classmethod
    def from_records(cls, source: Path | str | Iterable[Path | str]) -> StallAnalysis:
        """From run directories, a runs folder, or a ``.tgz`` of one (as committed under
        ``benchmarks/results``)."""
        from gpulens.record.reader import list_records

        if isinstance(source, (str, Path)):
            path = Path(source)
            if path.suffix in (".tgz", ".gz"):
                with tempfile.TemporaryDirectory() as tmp:
                    with tarfile.open(path) as tar:
                        tar.extractall(tmp, filter="data")
                    return cls.from_records(Path(tmp) / "runs")
            return cls.from_results(r.result() for r in list_records(path))
        return cls.from_results(RunResult.from_record(p) for p in source)

    def measured(self) -> dict[str, Measured | None]:
        """Time per sample of each role, repeats pooled; the paired runs give the fetch stall."""
        out = {role: pooled(runs) for role, runs in self.runs.items() if role != PAIRED_KIND}
        if self.runs.get(PAIRED_KIND):
            out[PAIRED_KIND] = pooled_paired(self.runs[PAIRED_KIND])
        return out

    def breakdown(self) -> dict[str, Any]:
        """Shares of compute and each stall with their 95% intervals (points)."""
        measured = self.measured()
        shares, cis = breakdown_of(measured)
        notes = []
        if self.runs.get(PAIRED_KIND) and measured.get(PAIRED_KIND) is None:
            notes.append(
                "fetch stall not known: the paired cold runs hold no paired_fetch in run.json "
                "(recorded before it was stored) and their prep rows cannot give it"
            )
        return {
            "notes": notes,
            "runs": {role: [r.run_id for r in runs] for role, runs in sorted(self.runs.items())},
            "throughput_ci95_pct": {
                k: 100 * m.half_width_s / m.per_sample_s for k, m in measured.items() if m
            },
            "breakdown_pct": shares,
            "breakdown_ci95_pp": cis,
        }


def _with_paired_fetch(run: RunResult) -> RunResult:
    """A paired cold run recorded before its fetch stall reached run.json: recomputed from its
    own prep rows (this needs the paired sampler's file split, so torch)."""
    from gpulens.stalls.paired_fetch import paired_fetch

    s, eff = run.summary, run.effective_config
    fetch = paired_fetch(
        run.record_dir,
        eff.get("paired_cold_samples"),
        eff.get("seed", 0),
        s.get("measured_start_unix_s"),
        s.get("measured_end_unix_s"),
    )
    return run.with_summary(paired_fetch=fetch) if fetch else run
