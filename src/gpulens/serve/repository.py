"""The served models: built on one device (``instances`` copies each), their v2 metadata, the
check of a request against it, and one batch run under ``torch.inference_mode``."""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpulens.serve.config import ModelEntry, ServeConfig
from gpulens.serve.models import ServeModelSpec, get_serve_model
from gpulens.serve.protocol import InferRequest, ProtocolError, Tensor

log = logging.getLogger(__name__)

VERSION = "1"
_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto``: bf16 on a GPU (autocast), fp32 on the CPU."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


@dataclass
class Input:
    """A checked request: its one input as a numpy array of ``n`` samples."""

    array: np.ndarray
    n: int


class ServedModel:
    """One model on one device, ``instances`` copies, each with its own CUDA stream."""

    def __init__(self, entry: ModelEntry, spec: ServeModelSpec, device: torch.device,
                 precision: str, instances: int, max_batch: int):  # fmt: skip
        self.name = entry.name
        self.spec = spec
        self.device = device
        self.precision = precision
        self.max_batch = max_batch
        cuda = device.type == "cuda"
        self.input = spec.inputs[0]
        # image models on a GPU run channels_last, as the training recipe does (cuDNN's fast
        # convolution kernels want NHWC); requests stay NCHW on the wire
        self.channels_last = cuda and self.input.datatype == "FP32" and len(self.input.shape) == 3
        base = spec.build().eval().to(device)
        if self.channels_last:
            base = base.to(memory_format=torch.channels_last)
        self.instances = [base] + [copy.deepcopy(base) for _ in range(instances - 1)]
        self.streams = [torch.cuda.Stream(device) for _ in self.instances] if cuda else None

    # ------------------------------------------------------------------------ metadata
    def metadata(self) -> dict:
        return {
            "name": self.name,
            "versions": [VERSION],
            "platform": "pytorch",
            "inputs": [t.metadata() for t in self.spec.inputs],
            "outputs": [t.metadata() for t in self.spec.outputs],
        }

    def config(self) -> dict:
        """Triton's model configuration, in brief (clients read ``max_batch_size``)."""
        doc = {
            "name": self.name,
            "platform": "pytorch",
            "max_batch_size": self.max_batch,
            "instance_group": [{"count": len(self.instances), "kind": self.device.type.upper()}],
            "input": [t.metadata() for t in self.spec.inputs],
            "output": [t.metadata() for t in self.spec.outputs],
        }
        if self.max_batch > 1:
            doc["dynamic_batching"] = {}
        return doc

    # ------------------------------------------------------------------------ requests
    def check(self, request: InferRequest, batching: bool) -> Input:
        """The request's input if it matches the metadata; a 400 naming the mismatch else."""
        if len(request.inputs) != 1 or request.inputs[0].name != self.input.name:
            got = [t.name for t in request.inputs]
            raise ProtocolError(
                f"model {self.name!r} takes one input {self.input.name!r}, got {got}"
            )
        tensor = request.inputs[0]
        want = self.input
        if tensor.datatype != want.datatype:
            raise ProtocolError(
                f"input {want.name!r} of model {self.name!r} is {want.datatype}, "
                f"got {tensor.datatype}"
            )
        shape = tuple(tensor.array.shape)
        if len(shape) != len(want.shape) + 1 or shape[1:] != want.shape or shape[0] < 1:
            raise ProtocolError(
                f"input {want.name!r} of model {self.name!r} has shape "
                f"{[-1, *want.shape]}, got {list(shape)}"
            )
        if batching and shape[0] > self.max_batch:
            raise ProtocolError(
                f"a request of {shape[0]} samples exceeds --max-batch {self.max_batch} of "
                f"model {self.name!r}: split it"
            )
        array = tensor.array
        if want.max_value is not None and array.size:
            lo, hi = int(array.min()), int(array.max())
            if lo < 0 or hi >= want.max_value:
                raise ProtocolError(
                    f"input {want.name!r} takes token ids in [0, {want.max_value}), got "
                    f"values in [{lo}, {hi}]"
                )
        for out in request.outputs:
            if out not in {o.name for o in self.spec.outputs}:
                raise ProtocolError(f"model {self.name!r} has no output {out!r}")
        return Input(array, shape[0])

    # ------------------------------------------------------------------------ batches
    def execute(self, arrays: Sequence[np.ndarray], instance: int):
        """Run the requests' inputs as one batch; each request's outputs (name -> Tensor list)
        and the split (input copy, forward, output copy) in ns."""
        t0 = time.perf_counter_ns()
        batch = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        if not batch.flags.writeable:  # torch wants writable memory (binary input is not)
            batch = batch.copy()
        stream = self.streams[instance] if self.streams else None
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx, torch.inference_mode():
            x = torch.from_numpy(np.ascontiguousarray(batch)).to(self.device, non_blocking=True)
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            t1 = time.perf_counter_ns()
            dtype = _AUTOCAST.get(self.precision)
            autocast = (
                torch.autocast(self.device.type, dtype=dtype)
                if dtype is not None
                else contextlib.nullcontext()
            )
            with autocast:
                y = self.instances[instance](x)
            if stream is not None:
                stream.synchronize()
            t2 = time.perf_counter_ns()
            out = y.float().cpu().numpy() if y.dtype != torch.float32 or y.is_cuda else y.numpy()
        name = self.spec.outputs[0].name
        results, start = [], 0
        for a in arrays:
            end = start + a.shape[0]
            results.append([Tensor(name, "FP32", out[start:end])])
            start = end
        t3 = time.perf_counter_ns()
        return results, (t1 - t0, t2 - t1, t3 - t2)

    def warm_up(self) -> None:
        """One full batch per instance (kernels chosen, memory allocated) before ready."""
        want = self.input
        n = max(1, self.max_batch)
        if want.datatype == "INT64":
            sample = np.zeros((n, *want.shape), dtype=np.int64)
        else:
            sample = np.zeros((n, *want.shape), dtype=np.float32)
        for i in range(len(self.instances)):
            self.execute([sample], i)


def build_models(config: ServeConfig, device: torch.device) -> dict[str, ServedModel]:
    """Every configured model, built, on ``device``, warmed up when the config says so."""
    precision = resolve_precision(config.precision, device)
    models = {}
    for entry in config.models:
        spec = get_serve_model(entry.workload)
        log.info("building %s (%s) on %s", entry.name, spec.workload, device)
        model = ServedModel(entry, spec, device, precision, config.instances,
                            max(1, config.max_batch))  # fmt: skip
        if config.warmup:
            model.warm_up()
        models[entry.name] = model
    return models
