"""The prediction error of each method on the cases it was validated on, and the arithmetic of
validation (``benchmarks/predict_validation.py`` measures; this module keeps the figures).

A figure is ``None`` until the method has been checked against real measurements."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Validated:
    """Mean absolute percentage error of a method's step time over ``cases`` measured runs."""

    mape_pct: float | None
    cases: int
    what: str


# From `python benchmarks/predict_validation.py` on the committed results, output in
# benchmarks/results/predict_validation-committed-H100_to_H200-2026-11-25.json: H100 records
# (benchmarks/results/*.tgz, tests/fixtures) predicting throughputs measured on an H200. One
# workload and one direction only: the committed results hold no H200 record. The whole-step
# design (latency-bound time kept) was chosen with these numbers in view: an in-sample figure
# until H200 -> H100 and other workloads are measured.
VALIDATED: dict[str, Validated] = {
    "whole_step_roofline": Validated(
        1.9, 21, "resnet50 bf16 b128, synthetic data: 7 H100 records x 3 H200 measurements"
    ),
    # `python benchmarks/predict_validation.py benchmarks/results/predict-records-7919c1d-*.tgz`
    # (predict_validation-H100_H200-2026-11-25.json): both directions, 5 workloads x 2 batch
    # sizes. Throughput 12.2% (kernel time alone 7.3%); the design that keeps a kernel's
    # non-ideal time was chosen with these numbers in view (whole-kernel scaling: 20.0%, kernel
    # time 15.7%), so the figure is in-sample until other GPUs are measured.
    "kernel_roofline": Validated(
        12.2,
        20,
        "H100 <-> H200, resnet18/50, vgg16, vit_b_16, gpt2 bf16 at 2 batch sizes each; the "
        "largest errors (vit_b_16 b32: 57% and 33%) are the H200 run's host: its GPU ran "
        "kernels 64% of the step (H100: 93%)",
    ),
    "same_gpu": Validated(None, 0, "the measured GPU: only the all-reduce is modelled"),
    "batch_size": Validated(None, 0, "another batch size on the measured GPU"),
    "workers": Validated(None, 0, "another number of loader workers"),
    # Regimes whose error adds to the method's (the larger figure is shown).
    "loader_bound": Validated(
        13.1,
        9,
        "resnet50 w8 cached JPEGs, H100 -> H200: the loader's own spread between "
        "sessions (1245-1619 samples/s on the H100 alone), which no GPU model removes",
    ),
    "multi_gpu": Validated(
        7.2,
        7,
        "1-GPU H100 records -> 2-GPU DDP on H200 over NVLink, all-reduce uncalibrated "
        "(the ring alone on the H200 pair: gpt2 0.9%, resnet50 5.1%)",
    ),
}


def error_pct(method: str, *regimes: str) -> float | None:
    """The validated error of ``method``, or the larger one of a regime it is used in
    (``loader_bound``, ``multi_gpu``); None where none of them was validated."""
    figures = [VALIDATED[k].mape_pct for k in (method, *regimes) if k in VALIDATED]
    known = [f for f in figures if f is not None]
    return max(known) if known else None


def ape_pct(predicted: float, measured: float) -> float:
    """Absolute percentage error of one prediction."""
    if measured <= 0:
        raise ValueError("a measured value must be positive")
    return abs(predicted - measured) / measured * 100.0


def mape_pct(pairs: list[tuple[float, float]]) -> float | None:
    """Mean absolute percentage error of (predicted, measured) pairs; None for none."""
    if not pairs:
        return None
    return sum(ape_pct(p, m) for p, m in pairs) / len(pairs)
