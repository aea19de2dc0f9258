"""Which jobs to put together, and how (``gpulens colocate --plan JOB...``).

From collocation results already measured (run records of kind ``colocate``, or result JSON
files), every measured group of jobs gets its best mechanism and setting: the highest normalized
aggregate throughput whose jobs all stay within the slowdown cap. A job alone always counts 1.0.

The objective is normalized throughput per GPU: the sum over groups of their normalized aggregate
throughput, divided by the number of GPUs (groups) used. The planner is greedy (take the best
measured group that still fits the remaining jobs, repeat, the rest alone); the exhaustive search
tries every partition of the jobs into measured groups and singletons. ``quality`` is the plan's
objective over the exhaustive one (1.0 = the plan is the best that was measured).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from gpulens.errors import UsageError
from gpulens.workloads.jobspec import JobSpec

MAX_PLAN_JOBS = 12


@dataclass(frozen=True)
class GroupOption:
    """One measured way to run a group: ``keys`` sorted, ``normalized`` aligned to them."""

    keys: tuple[str, ...]
    mechanism: str
    setting: str
    normalized: tuple[float, ...]
    slowdowns: tuple[float, ...]
    source: str | None = None

    @property
    def aggregate(self) -> float:
        return sum(self.normalized)

    @property
    def worst_slowdown(self) -> float:
        return max(self.slowdowns)


def options_from_docs(docs: list[dict[str, Any]]) -> list[GroupOption]:
    """Every successful together-measurement in ``docs`` (oldest first; a later measurement of
    the same group, mechanism and setting replaces an earlier one)."""
    latest: dict[tuple, GroupOption] = {}
    for doc in docs:
        for r in doc.get("results") or []:
            if r.get("status") != "ok" or r.get("normalized_aggregate_throughput") is None:
                continue
            rows = []
            for j in r["jobs"]:
                alone, together = j.get("throughput_alone"), j.get("throughput_together")
                if not alone or together is None or together <= 0:
                    break
                rows.append((j["key"], together / alone, alone / together))
            else:
                rows.sort()
                opt = GroupOption(
                    tuple(k for k, _, _ in rows), r["mechanism"], r.get("setting") or "default",
                    tuple(n for _, n, _ in rows), tuple(s for _, _, s in rows), doc.get("run_id"),
                )  # fmt: skip
                latest[(opt.keys, opt.mechanism, opt.setting)] = opt
    return list(latest.values())


def best_options(
    options: list[GroupOption], max_slowdown: float | None
) -> dict[tuple[str, ...], GroupOption]:
    """Per measured group, the option with the highest aggregate within the cap."""
    best: dict[tuple[str, ...], GroupOption] = {}
    for o in options:
        if max_slowdown is not None and o.worst_slowdown > max_slowdown:
            continue
        if o.keys not in best or o.aggregate > best[o.keys].aggregate:
            best[o.keys] = o
    return best


def _sub(counts: Counter, keys: tuple[str, ...]) -> Counter | None:
    need = Counter(keys)
    if any(counts[k] < n for k, n in need.items()):
        return None
    left = counts.copy()
    left.subtract(need)
    return +left


def greedy_plan(keys: list[str], best: dict[tuple[str, ...], GroupOption]) -> list[Any]:
    """Best measured group first while it beats running its jobs alone; the rest alone."""
    left = Counter(keys)
    blocks: list[Any] = []
    for opt in sorted(best.values(), key=lambda o: (-o.aggregate, o.keys)):
        if opt.aggregate <= 1.0 or len(opt.keys) < 2:
            continue
        while (rest := _sub(left, opt.keys)) is not None:
            blocks.append(opt)
            left = rest
    blocks += [(k,) for k in sorted(left.elements())]
    return blocks


def exhaustive_plan(keys: list[str], best: dict[tuple[str, ...], GroupOption]) -> list[Any]:
    """Every partition of ``keys`` into measured groups and singletons; the best per GPU."""
    if len(keys) > MAX_PLAN_JOBS:
        raise UsageError(f"--plan searches at most {MAX_PLAN_JOBS} jobs exhaustively")
    order = sorted(set(keys))
    groups = [o for o in best.values() if len(o.keys) >= 2]

    @cache
    def solve(counts: tuple[int, ...]) -> dict[int, tuple[float, tuple]]:
        """number of groups -> (best sum, blocks) for the multiset ``counts``."""
        if not any(counts):
            return {0: (0.0, ())}
        first = next(k for k, n in zip(order, counts, strict=True) if n)
        cur = Counter(dict(zip(order, counts, strict=True)))
        out: dict[int, tuple[float, tuple]] = {}
        choices: list[Any] = [(first,)] + [g for g in groups if first in g.keys]
        for block in choices:
            block_keys = block if isinstance(block, tuple) else block.keys
            value = 1.0 if isinstance(block, tuple) else block.aggregate
            rest = _sub(cur, block_keys)
            if rest is None:
                continue
            sub = solve(tuple(rest[k] for k in order))
            for g, (s, blocks) in sub.items():
                cand = (s + value, (block, *blocks))
                if g + 1 not in out or cand[0] > out[g + 1][0]:
                    out[g + 1] = cand
        return out

    table = solve(tuple(Counter(keys)[k] for k in order))
    _g, (_s, blocks) = max(table.items(), key=lambda item: (item[1][0] / item[0], -item[0]))
    return list(blocks)


def _describe(blocks: list[Any], names_by_key: dict[str, list[str]]) -> dict[str, Any]:
    pools = {k: list(v) for k, v in names_by_key.items()}
    groups = []
    total = 0.0
    for b in blocks:
        keys = b if isinstance(b, tuple) else b.keys
        names = [pools[k].pop(0) for k in keys]
        if isinstance(b, tuple):
            groups.append({"jobs": names, "keys": list(keys), "mechanism": "alone",
                           "setting": None, "normalized_aggregate_throughput": 1.0,
                           "max_slowdown": 1.0})  # fmt: skip
            total += 1.0
        else:
            groups.append({"jobs": names, "keys": list(keys), "mechanism": b.mechanism,
                           "setting": b.setting, "normalized_aggregate_throughput": b.aggregate,
                           "max_slowdown": b.worst_slowdown, "source_run": b.source})  # fmt: skip
            total += b.aggregate
    gpus = len(groups)
    return {"groups": groups, "gpus": gpus, "normalized_throughput": total,
            "normalized_throughput_per_gpu": total / gpus if gpus else None}  # fmt: skip


def plan(
    jobs: list[JobSpec], docs: list[dict[str, Any]], max_slowdown: float | None = None
) -> dict[str, Any]:
    """The greedy plan, the exhaustive best, and how close the plan comes."""
    if not jobs:
        raise UsageError("give the jobs to place, e.g. --plan resnet18 resnet18 resnet50")
    keys = [j.key for j in jobs]
    names_by_key: dict[str, list[str]] = {}
    for j in jobs:
        names_by_key.setdefault(j.key, []).append(j.name)
    options = options_from_docs(docs)
    relevant = [o for o in options if not (Counter(o.keys) - Counter(keys))]
    best = best_options(relevant, max_slowdown)
    greedy = _describe(greedy_plan(keys, best), names_by_key)
    exhaustive = _describe(exhaustive_plan(keys, best), names_by_key)
    quality = None
    if exhaustive["normalized_throughput_per_gpu"]:
        quality = (
            greedy["normalized_throughput_per_gpu"] / exhaustive["normalized_throughput_per_gpu"]
        )
    distinct = sorted(set(keys))
    pairs = [(a, b) for i, a in enumerate(distinct) for b in distinct[i:]
             if (a != b or Counter(keys)[a] > 1)]  # fmt: skip
    missing = [list(p) for p in pairs if tuple(sorted(p)) not in {o.keys for o in relevant}]
    return {
        "jobs": [j.name for j in jobs],
        "max_slowdown": max_slowdown,
        "measured_options": len(relevant),
        "measured_groups": len({o.keys for o in relevant}),
        "missing_pairs": missing,
        "plan": greedy,
        "exhaustive": exhaustive,
        "quality": quality,
        "recommendation": _sentence(greedy, quality, missing),
    }


def _sentence(p: dict[str, Any], quality: float | None, missing: list) -> str:
    parts = []
    for g in p["groups"]:
        if g["mechanism"] == "alone":
            parts.append(f"{g['jobs'][0]} alone")
        else:
            setting = f" ({g['setting']})" if g["setting"] not in (None, "default") else ""
            parts.append(f"{' + '.join(g['jobs'])} under {g['mechanism']}{setting}")
    text = (
        f"{'; '.join(parts)}: {p['gpus']} GPU(s), "
        f"{p['normalized_throughput_per_gpu']:.2f}x throughput per GPU"
    )
    if quality is not None:
        text += f", {100 * quality:.0f}% of the best found by exhaustive search"
    if missing:
        text += f" ({len(missing)} pair(s) never measured: run gpulens colocate on them)"
    return text


def load_docs(runs_root: Path, files: list[Path] | None = None) -> list[dict[str, Any]]:
    """Collocation results: finished ``colocate`` records under ``runs_root`` (oldest first),
    then the given JSON files (a colocate document, a list of them, or a suite document with
    ``experiments[].colocate``)."""
    from gpulens.record.reader import list_records

    docs: list[dict[str, Any]] = []
    for rec in list_records(runs_root):
        if rec.meta.get("kind") == "colocate" and rec.status == "finished":
            doc = (rec.meta.get("summary") or {}).get("colocate")
            if doc:
                docs.append({**doc, "run_id": rec.run_id})
    for f in files or []:
        try:
            data = json.loads(Path(f).read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read collocation results from {f}: {exc}") from None
        docs += _docs_in(data)
    return docs


def _docs_in(data: Any) -> list[dict[str, Any]]:
    if isinstance(data, list):
        return [d for item in data for d in _docs_in(item)]
    if not isinstance(data, dict):
        return []
    if "results" in data and "jobs" in data:
        return [data]
    out = []
    for item in data.get("experiments") or []:
        if isinstance(item, dict) and isinstance(item.get("colocate"), dict):
            out.append(item["colocate"])
    return out
