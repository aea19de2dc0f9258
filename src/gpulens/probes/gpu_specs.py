"""Peak dense throughput of common GPUs, for MFU. Dated: vendors' datasheets as of 2026-11.

Values are dense (no sparsity) tensor-core TFLOP/s, except ``fp32`` which is the plain (non-tensor)
FP32 rate, the one PyTorch uses for float32 matmuls unless TF32 is allowed.
"""

from __future__ import annotations

CATALOG_DATE = "2026-11-22"

# name fragment (lower case, matched against NVML's name) -> peak TFLOP/s per precision
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "gb200": {"bf16": 2500.0, "fp16": 2500.0, "tf32": 1250.0, "fp32": 80.0},
    "b200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0},
    "h200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "h100 nvl": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "h100 pcie": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "h100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "gh200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "l40s": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "l4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "a100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "a10g": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2},
    "a10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "v100": {"bf16": 0.0, "fp16": 125.0, "tf32": 0.0, "fp32": 15.7},
    "t4": {"bf16": 0.0, "fp16": 65.0, "tf32": 0.0, "fp32": 8.1},
}


def peak_flops(gpu_name: str, precision: str) -> float | None:
    """Peak FLOP/s of ``gpu_name`` at ``precision`` (fp32, tf32, bf16, fp16); None if unknown.
    On a GPU without TF32 (before Ampere: V100, T4) tf32 gives the fp32 peak: torch's TF32
    switches leave fp32 math at the fp32 rate there."""
    lowered = gpu_name.lower()
    # Longest fragment first, so "h100 pcie" wins over "h100".
    for fragment in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if fragment in lowered:
            peaks = PEAK_TFLOPS[fragment]
            tflops = peaks.get(precision) or (peaks.get("fp32") if precision == "tf32" else None)
            return tflops * 1e12 if tflops else None
    return None
