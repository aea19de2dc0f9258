"""The CUDA kernels of a torch profiler window, each with the FLOPs and bytes of the op that
launched it (from the op's input shapes: ``gpulens run --torch-profiler N`` records them).

FLOPs are counted for the ops that do the arithmetic of training (matrix products,
convolutions and their backward, fused attention); other ops with tensor inputs (elementwise,
normalisation, pooling, the optimizer's foreach ops) count 0 FLOPs and the bytes of their inputs
plus an output the size of the largest input. Ops that recorded no shapes get neither, and the
roofline scales their kernels as the measured kernels of the same class. An op's FLOPs and
bytes are shared among its kernels by duration, so that every kernel of an op has the op's
arithmetic intensity.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
from pathlib import Path

from gpulens.errors import UsageError
from gpulens.predict.roofline import Kernel

log = logging.getLogger(__name__)

DTYPE_BYTES = {
    "float": 4, "float32": 4, "c10::half": 2, "half": 2, "c10::bfloat16": 2, "bfloat16": 2,
    "double": 8, "long int": 8, "int": 4, "bool": 1, "unsigned char": 1, "signed char": 1,
    "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1,
}  # fmt: skip
# Where the stride, padding, dilation and groups arguments sit in each convolution op.
CONV_ARGS = {
    "aten::convolution": (3, 4, 5, 8),
    "aten::_convolution": (3, 4, 5, 8),
    "aten::cudnn_convolution": (3, 2, 4, 5),
    "aten::mkldnn_convolution": (4, 3, 5, 6),
}


def _numel(shape) -> int:
    """Elements of one input: a shape (list of ints) or a tensor list (list of shapes, as
    ``aten::cat`` records it); 0 for scalars and anything unreadable."""
    if not isinstance(shape, list) or not shape:
        return 0
    if all(isinstance(d, int) for d in shape):
        return math.prod(shape)
    return sum(_numel(inner) for inner in shape)


def _ints(value, n: int) -> list[int]:
    """A concrete argument such as ``'[2, 2]'`` or ``'1'`` as ``n`` ints (1 where unreadable)."""
    try:
        parsed = json.loads(value) if isinstance(value, str) and value else 1
    except ValueError:
        return [1] * n
    parsed = parsed if isinstance(parsed, list) else [parsed] * n
    return [int(v) for v in parsed] if len(parsed) == n else [1] * n


def op_flops_bytes(name: str, args: dict) -> tuple[float | None, float | None]:
    """FLOPs and bytes (inputs + output) of one op from its recorded shapes: (0, bytes) for an
    op with no FLOP formula, (None, None) for one that recorded no tensor shapes."""
    dims = args.get("Input Dims") or []
    types = args.get("Input type") or []
    concrete = args.get("Concrete Inputs") or []
    elt = next((DTYPE_BYTES[t] for t in types if t in DTYPE_BYTES), 4)
    in_bytes = sum(_numel(d) for d in dims) * elt
    # plain tensors only: the FLOP formulas below read shapes, never tensor lists
    tensors = [d for d in dims if isinstance(d, list) and d and all(isinstance(x, int) for x in d)]
    flops = out = None
    mats = [d for d in tensors if len(d) >= 2]
    if name in ("aten::mm", "aten::addmm") and len(mats) >= 2:
        (m, k), (_, n) = mats[-2][-2:], mats[-1][-2:]
        flops, out = 2.0 * m * n * k, m * n
    elif name in ("aten::bmm", "aten::baddbmm") and len(mats) >= 2 and len(mats[-1]) == 3:
        (b, m, k), n = mats[-2], mats[-1][-1]
        flops, out = 2.0 * b * m * n * k, b * m * n
    elif name in CONV_ARGS and len(tensors) >= 2 and len(tensors[0]) == 4:
        (batch, _, h, w), (o, cg, kh, kw) = tensors[0], tensors[1]
        si, pi, di, gi = CONV_ARGS[name]
        pick = lambda i, n: _ints(concrete[i] if i < len(concrete) else "", n)  # noqa: E731
        (sh, sw), (ph, pw), (dh, dw) = pick(si, 2), pick(pi, 2), pick(di, 2)
        ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
        wo = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        flops, out = 2.0 * batch * o * ho * wo * cg * kh * kw, batch * o * ho * wo
    elif name == "aten::convolution_backward" and len(tensors) >= 3:
        (batch, o, ho, wo), (_, cg, kh, kw) = tensors[0], tensors[2]
        flops, out = (
            4.0 * batch * o * ho * wo * cg * kh * kw,
            _numel(tensors[1]) + _numel(tensors[2]),
        )  # input and weight gradients: twice the forward's FLOPs
    elif "attention" in name and len(tensors) >= 3 and len(tensors[-3]) == 4:
        q, k = (tensors[1], tensors[2]) if "backward" in name else (tensors[0], tensors[1])
        b, heads, length, d = q
        fwd = 4.0 * b * heads * length * k[2] * d
        flops = 2.5 * fwd if "backward" in name else fwd
        out = _numel(q) * (3 if "backward" in name else 1)
    if flops is None:
        # no arithmetic worth counting (elementwise, norms, pooling, copies): its bytes only,
        # the output taken as large as its largest input
        largest = max((_numel(d) for d in dims), default=0)
        return (0.0, in_bytes + largest * elt) if in_bytes else (None, None)
    return flops, in_bytes + out * elt


def load_trace(trace_path: Path) -> tuple[dict, list[dict]]:
    """The ops (by External id) and the device-side events (kernels, memsets, device-to-device
    copies) of a torch profiler Chrome trace (``.json`` or ``.json.gz``)."""
    path = Path(trace_path)
    try:
        # a .gz trace (as torch's tensorboard handler writes them) is read as it is
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        events = json.loads(raw)["traceEvents"]
    except (OSError, EOFError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(
            f"cannot read the profiler trace {trace_path} ({exc}): rerun with --torch-profiler N"
        ) from exc
    ops = {
        e["args"]["External id"]: e
        for e in events
        if e.get("cat") == "cpu_op" and "External id" in (e.get("args") or {})
    }
    # host-device copies are left out: PCIe, a figure no GPU swap or batch model changes
    device = [
        e for e in events
        if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and e.get("dur") is not None
        and not (e.get("cat") == "gpu_memcpy" and "DtoD" not in str(e.get("name")))
    ]  # fmt: skip
    return ops, device


def read_kernels(trace_path: Path) -> list[Kernel]:
    """The CUDA kernels (and device-side memsets and copies) of a torch profiler Chrome trace,
    each with its launching op's FLOPs and bytes."""
    ops, device = load_trace(trace_path)
    op_time: dict[object, float] = {}
    for e in device:
        ext = (e.get("args") or {}).get("External id")
        op_time[ext] = op_time.get(ext, 0.0) + float(e["dur"])
    kernels = []
    for e in device:
        ext = (e.get("args") or {}).get("External id")
        op = ops.get(ext)
        flops = nbytes = None
        if op is not None:
            flops, nbytes = op_flops_bytes(op.get("name", ""), op.get("args") or {})
            share = float(e["dur"]) / op_time[ext] if op_time[ext] else 1.0
            flops = flops * share if flops is not None else None
            nbytes = nbytes * share if nbytes else None
        kernels.append(
            Kernel(str(e.get("name")), float(e["dur"]) * 1e-6, op and op.get("name"), flops, nbytes)
        )
    log.debug("%d kernels in %s", len(kernels), trace_path)
    return kernels
