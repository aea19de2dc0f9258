"""One KServe v2 (Open Inference Protocol) infer request per tenant, built once from the
model's metadata (``GET /v2/models/{name}``) and sent unchanged for every arrival.

Shapes: the first ``-1`` dimension is the batch (the tenant's ``batch``), any other ``-1`` is
1. Inputs larger than the threshold travel as binary tensor data (the protocol's extension:
``binary_data_size`` per input, the JSON header's length in ``Inference-Header-Content-Length``,
the raw little-endian bytes after the JSON); smaller ones as JSON ``data``. Pure: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpulens.errors import RuntimeFailure, UsageError

# KServe v2 datatype -> numpy dtype (BF16 travels as its raw 16 bits; BYTES has no dtype)
DTYPES = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
    "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
    "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
    "BF16": np.uint16,
}  # fmt: skip
BINARY_HEADER = "Inference-Header-Content-Length"


@dataclass(frozen=True)
class InferRequest:
    """A ready-to-send request: the path under the base URL, the body and its headers."""

    path: str
    body: bytes
    headers: dict
    input_bytes: int
    binary: bool


def concrete_shape(shape: list, batch: int) -> list[int]:
    """The metadata shape with the first -1 as ``batch`` and any other -1 as 1."""
    out, batched = [], False
    for dim in shape:
        dim = int(dim)
        if dim < 0:
            out.append(batch if not batched else 1)
            batched = True
        else:
            out.append(dim)
    return out


def random_tensor(datatype: str, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    """Random values of the right type: normal floats, small non-negative integers (valid token
    ids for any vocabulary), random booleans."""
    if datatype == "BF16":
        f32 = rng.standard_normal(shape).astype(np.float32)
        return (f32.view(np.uint32) >> 16).astype(np.uint16)
    dtype = DTYPES[datatype]
    if datatype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(0, 100, size=shape).astype(dtype)


def kserve_request(
    metadata: dict, batch: int, rng: np.random.Generator, binary_threshold_bytes: int = 4096
) -> InferRequest:
    """The infer request for a model described by ``metadata``."""
    name = metadata.get("name")
    inputs = metadata.get("inputs")
    if not name or not isinstance(inputs, list) or not inputs:
        raise RuntimeFailure(
            f"model metadata without name or inputs ({json.dumps(metadata)[:200]}): gpulens "
            "load cannot build a request from it; give one with --input MODEL=request.json (a "
            "KServe v2 infer request body), or check --url"
        )
    header_inputs, blobs = [], []
    total = 0
    for spec in inputs:
        datatype = str(spec.get("datatype", "")).upper()
        shape = concrete_shape(spec.get("shape") or [], batch)
        entry: dict = {"name": spec["name"], "shape": shape, "datatype": datatype}
        if datatype == "BYTES":
            count = int(np.prod(shape)) if shape else 1
            entry["data"] = ["gpulens"] * count
            total += 7 * count
        elif datatype in DTYPES:
            array = np.ascontiguousarray(random_tensor(datatype, shape, rng))
            raw = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
            total += len(raw)
            if len(raw) > binary_threshold_bytes:
                entry["parameters"] = {"binary_data_size": len(raw)}
                blobs.append(raw)
            else:
                entry["data"] = array.reshape(-1).tolist()
        else:
            raise RuntimeFailure(
                f"model {name}: input {spec.get('name')} has datatype {datatype!r}, which "
                f"gpulens load cannot fill (it knows {', '.join([*DTYPES, 'BYTES'])})"
            )
        header_inputs.append(entry)
    header = json.dumps({"inputs": header_inputs}, separators=(",", ":")).encode()
    path = f"/v2/models/{name}/infer"
    if not blobs:
        return InferRequest(path, header, {"Content-Type": "application/json"}, total, False)
    headers = {BINARY_HEADER: str(len(header)), "Content-Type": "application/octet-stream"}
    return InferRequest(path, header + b"".join(blobs), headers, total, True)


def request_from_file(model: str, path: str) -> InferRequest:
    """The infer request in ``path`` (a KServe v2 infer request body, JSON), sent as it is:
    for servers whose metadata does not describe their inputs."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(
            f"--input {model}={path}: cannot read it ({exc.strerror or exc})"
        ) from None
    except ValueError as exc:
        raise UsageError(f"--input {model}={path}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list) or not doc["inputs"]:
        raise UsageError(
            f'--input {model}={path}: write a KServe v2 infer request, {{"inputs": [{{"name", '
            '"shape", "datatype", "data"}]}'
        )
    body = json.dumps(doc, separators=(",", ":")).encode()
    return InferRequest(f"/v2/models/{model}/infer", body, {"Content-Type": "application/json"},
                        len(body), False)  # fmt: skip


def decode_binary_request(body: bytes, header_length: int | None) -> dict:
    """The JSON part of a request (for tests and fake servers): with binary data, the first
    ``header_length`` bytes."""
    if header_length is None:
        return json.loads(body)
    return json.loads(body[:header_length])
