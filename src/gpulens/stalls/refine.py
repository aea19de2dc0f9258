"""The repeat planner: while a share's interval is wider than the target, which run to repeat
(the one that narrows the widest share most per second) and whether it fits the budget. Pure."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from gpulens.run.result import RunResult
from gpulens.stalls.budget import TimeBudget
from gpulens.stalls.config import StallsConfig
from gpulens.stalls.model import Measured, breakdown_of, measure_all

# Runs of one kind (cached, cold) pooled at most: high enough that the time budget is what
# stops a user who asks for more time (cold passes over storage whose speed varies from pass to
# pass by ±8% needed about 60 runs for a ±3-point fetch stall on an H100 VM).
MAX_REPEATS = 64
COST_MARGIN = 1.1  # a repeat may run longer than the slowest one so far


def widest(measured: dict[str, Measured | None]) -> float:
    _, cis = breakdown_of(measured)
    return max((v for v in cis.values() if v is not None), default=0.0)


def best_repeat(
    measured: dict[str, Measured | None],
    counts: dict[str, int],
    kinds: list[str],
    cost_s: dict[str, float],
) -> tuple[str | None, dict[str, Measured | None]]:
    """The kind whose next run narrows the widest share most per second, and the intervals
    expected after it (``measured`` unchanged when none helps)."""
    worst = widest(measured)
    best, best_rate, after = None, 0.0, measured
    for kind in kinds:
        m, n = measured.get(kind), counts.get(kind, 0)
        if m is None or n == 0:
            continue
        # One more run like the others shrinks the pooled interval by sqrt(n / (n + 1)).
        narrower = {
            **measured,
            kind: replace(m, half_width_s=m.half_width_s * math.sqrt(n / (n + 1))),
        }
        rate = (worst - widest(narrower)) / cost_s[kind]
        if rate > best_rate:
            best, best_rate, after = kind, rate, narrower
    return best, after


def plan_to_target(
    measured: dict[str, Measured | None],
    counts: dict[str, int],
    kinds: list[str],
    cost_s: dict[str, float],
    target_pp: float,
    limit: int = 2 * MAX_REPEATS,
) -> tuple[float, dict[str, int]] | None:
    """Seconds of further runs, and how many of each kind, that would bring every share within
    ``target_pp`` if the runs to come scatter like those so far; None when ``limit`` more runs
    (or :data:`MAX_REPEATS` of a kind) would not."""
    counts, total_s = dict(counts), 0.0
    added = {k: 0 for k in kinds}
    for _ in range(limit):
        if widest(measured) <= target_pp:
            return total_s, {k: n for k, n in added.items() if n}
        open_kinds = [k for k in kinds if counts.get(k, 0) < MAX_REPEATS]
        kind, measured = best_repeat(measured, counts, open_kinds, cost_s)
        if kind is None:
            return None
        counts[kind] += 1
        added[kind] += 1
        total_s += cost_s[kind]
    return (
        (total_s, {k: n for k, n in added.items() if n}) if widest(measured) <= target_pp else None
    )


def time_to_target(
    measured: dict[str, Measured | None],
    counts: dict[str, int],
    kinds: list[str],
    cost_s: dict[str, float],
    target_pp: float,
    limit: int = 2 * MAX_REPEATS,
) -> float | None:
    """Seconds of further runs that would bring every share within ``target_pp``, if the runs
    to come scatter like those so far; None when ``limit`` more runs would not."""
    plan = plan_to_target(measured, counts, kinds, cost_s, target_pp, limit)
    return None if plan is None else plan[0]


def _spread_pct(runs: list[RunResult]) -> float | None:
    """Run-to-run standard deviation of throughput, % of the mean (None under 2 runs)."""
    import statistics

    xs = [r.throughput_samples_per_s for r in runs if r.throughput_samples_per_s]
    if len(xs) < 2:
        return None
    return 100 * statistics.stdev(xs) / statistics.fmean(xs)


def refine(
    config: StallsConfig,
    repeats: dict[str, list[RunResult]],
    rerun: dict[str, Callable[[], RunResult | None]],
    cost_s: dict[str, float],
    t0: float,
    say: Callable[[str], None],
    notes: list[str],
    budget: TimeBudget | None = None,
) -> None:
    """While a share's 95% interval is wider than the target, repeat the run (cached, a cold
    pass or a paired cold run) that narrows the widest share most per second, if it fits in
    the time budget; repeats of a kind are pooled. ``rerun[kind]`` returns None when it
    cannot repeat. ``cost_s[kind]`` is the slowest run of that kind so far (updated here).
    ``budget`` keeps its reserve (storing the runs) out of the time for repeats."""
    import time

    while True:
        measured = measure_all(repeats)
        worst = widest(measured)
        if worst <= config.until_ci_pct:
            return
        elapsed_s = time.perf_counter() - t0
        limit_s = config.time_budget_s - (budget.reserve_s(1) if budget is not None else 0.0)
        counts = {k: len(v) for k, v in repeats.items()}
        fits = [
            kind
            for kind in rerun
            if counts.get(kind, 0) < MAX_REPEATS
            and elapsed_s + COST_MARGIN * cost_s[kind] <= limit_s
        ]
        best, _ = best_repeat(measured, counts, fits, cost_s)
        if best is None:
            plan = plan_to_target(measured, counts, list(rerun), cost_s, config.until_ci_pct)
            if plan is not None:
                more_s, added = plan
                runs = ", ".join(f"{n} more {kind} run{'s' if n > 1 else ''}"
                                 for kind, n in added.items())  # fmt: skip
                spreads = [
                    f"the {kind} runs' throughputs differ by ±{sp:.1f}% (SD) from one run to the "
                    "next, so only more of them narrow the interval"
                    for kind in added
                    if (sp := _spread_pct(repeats.get(kind, []))) is not None and sp > 2.0
                ]
                need = (
                    f"; about {more_s:.0f} s more of runs would reach it "
                    f"(--time-budget {config.time_budget_s + more_s:.0f}: {runs})"
                    + (f"; {'; '.join(spreads)}" if spreads else "")
                )
            else:
                need = f"; even {MAX_REPEATS} runs of each would likely not reach it"
            notes.append(
                f"the widest share's 95% interval is ±{worst:.1f} points, short of "
                f"±{config.until_ci_pct:g}: no further repeat of the cached run or the cold one "
                f"fits in the {config.time_budget_s:.0f} s budget (--time-budget) or under the "
                f"limit of {MAX_REPEATS} runs of each{need}"
            )
            return
        say(f"widest interval ±{worst:.1f} points: repeating the {best} run")
        t_run0 = time.perf_counter()
        again = rerun[best]()
        if again is None:
            del rerun[best]
            continue
        repeats[best].append(again)
        cost_s[best] = max(cost_s[best], time.perf_counter() - t_run0)
