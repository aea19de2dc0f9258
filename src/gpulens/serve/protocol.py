"""The Open Inference Protocol (KServe v2 REST) codec: JSON tensors and the binary tensor data
extension. numpy only: no web framework, no torch.

A request body is JSON, or (binary extension) ``Inference-Header-Content-Length`` bytes of JSON
followed by the inputs whose ``parameters.binary_data_size`` is set, in input order. A response
carries outputs as JSON ``data`` or, when asked (output parameter ``binary_data`` or request
parameter ``binary_data_output``), as raw little-endian bytes after the JSON header. Every problem
with a request is a :class:`ProtocolError` with its HTTP status; its message goes back as
``{"error": "..."}``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

HEADER_LENGTH = "Inference-Header-Content-Length"
BF16 = "BF16"
BYTES = "BYTES"
# v2 datatype -> numpy dtype (little-endian); BYTES is an object array of bytes, BF16 travels as
# its 16-bit pattern and is widened to float32 here.
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("bool"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    BF16: np.dtype("<u2"),
    BYTES: np.dtype("object"),
}
DATATYPES = tuple(DTYPES)


class ProtocolError(Exception):
    """A request the server cannot take: ``status`` is the HTTP status (4xx, or 503)."""

    def __init__(self, message: str, status: int = 400, retry_after_s: int | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s

    @property
    def message(self) -> str:
        return str(self)


@dataclass
class Tensor:
    """One named tensor: its v2 datatype, its shape and its data (numpy, row-major)."""

    name: str
    datatype: str
    array: np.ndarray

    @property
    def shape(self) -> list[int]:
        return list(self.array.shape)


@dataclass
class InferRequest:
    """A decoded inference request."""

    inputs: list[Tensor]
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    # requested outputs: name -> binary?; empty: all outputs, binary if ``binary_output``
    outputs: dict[str, bool] = field(default_factory=dict)
    binary_output: bool = False

    def wants_binary(self, name: str) -> bool:
        return self.outputs.get(name, self.binary_output)


# ------------------------------------------------------------------------------ datatypes
def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """16-bit bfloat16 patterns (uint16) to float32 (exact)."""
    return (bits.astype("<u4") << 16).view("<f4")


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 patterns (uint16), rounding to nearest even."""
    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4")
    rounded = bits + (0x7FFF + ((bits >> 16) & 1))
    return (rounded >> 16).astype("<u2")


def datatype_of(array: np.ndarray) -> str:
    """The v2 datatype of a numpy array (object arrays are BYTES)."""
    if array.dtype == object or array.dtype.kind in "SU":
        return BYTES
    for name, dtype in DTYPES.items():
        if name not in (BF16, BYTES) and dtype == array.dtype.newbyteorder("<"):
            return name
    raise ProtocolError(f"no v2 datatype for numpy {array.dtype}", status=500)


def _shape(raw: Any, where: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw
    ):
        raise ProtocolError(f"{where}: 'shape' must be a list of non-negative integers")
    return tuple(raw)


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _from_json_data(data: Any, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    if not isinstance(data, list):
        raise ProtocolError(f"{where}: 'data' must be a JSON array (row-major)")
    try:
        if datatype == BYTES:
            flat = np.asarray(data, dtype=object).reshape(-1)
            array = np.array(
                [x.encode() if isinstance(x, str) else bytes(x) for x in flat], dtype=object
            )
        elif datatype == BF16:
            array = np.asarray(data, dtype="<f4")
        else:
            array = np.asarray(data, dtype=DTYPES[datatype])
    except (ValueError, TypeError, OverflowError) as exc:
        raise ProtocolError(f"{where}: 'data' does not hold {datatype} values ({exc})") from None
    if array.size != _count(shape):
        raise ProtocolError(
            f"{where}: 'data' has {array.size} elements but shape {list(shape)} needs "
            f"{_count(shape)}"
        )
    return array.reshape(shape)


def _from_binary(raw: memoryview, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    n = _count(shape)
    if datatype == BYTES:
        items, offset = [], 0
        while offset < len(raw):
            if offset + 4 > len(raw):
                raise ProtocolError(f"{where}: truncated BYTES element length")
            size = int.from_bytes(raw[offset : offset + 4], "little")
            offset += 4
            if offset + size > len(raw):
                raise ProtocolError(f"{where}: truncated BYTES element")
            items.append(bytes(raw[offset : offset + size]))
            offset += size
        if len(items) != n:
            raise ProtocolError(f"{where}: {len(items)} BYTES elements, shape needs {n}")
        return np.array(items, dtype=object).reshape(shape)
    dtype = DTYPES[datatype]
    if len(raw) != n * dtype.itemsize:
        raise ProtocolError(
            f"{where}: binary_data_size is {len(raw)} bytes but shape {list(shape)} of "
            f"{datatype} needs {n * dtype.itemsize}"
        )
    array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return bf16_to_float32(array) if datatype == BF16 else array


def _dict(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(f"{where} must be a JSON object")
    return value


# ------------------------------------------------------------------------------ requests
def parse_header_length(value: str | None, body_len: int) -> int | None:
    """The ``Inference-Header-Content-Length`` header as an int (None when absent)."""
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise ProtocolError(f"{HEADER_LENGTH} must be an integer, got {value!r}") from None
    if not 0 < n <= body_len:
        raise ProtocolError(f"{HEADER_LENGTH} is {n} but the body has {body_len} bytes")
    return n


def decode_request(body: bytes, header_length: int | None = None) -> InferRequest:
    """Decode an inference request body (see the module docstring)."""
    view = memoryview(body)
    head = view[:header_length] if header_length is not None else view
    try:
        doc = json.loads(bytes(head))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed JSON in the request body: {exc}") from None
    if not isinstance(doc, dict):
        raise ProtocolError("the request body must be a JSON object with 'inputs'")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise ProtocolError("the request needs 'inputs': a non-empty list of tensors")
    offset = header_length or len(body)
    inputs = []
    for i, raw in enumerate(raw_inputs):
        if not isinstance(raw, dict):
            raise ProtocolError(f"inputs[{i}] must be a JSON object")
        name, datatype = raw.get("name"), raw.get("datatype")
        where = f"input '{name}'" if isinstance(name, str) else f"inputs[{i}]"
        if not isinstance(name, str):
            raise ProtocolError(f"{where}: 'name' must be a string")
        if not isinstance(datatype, str) or datatype not in DTYPES:
            raise ProtocolError(
                f"{where}: unknown datatype {datatype!r}; use one of {', '.join(DATATYPES)}"
            )
        shape = _shape(raw.get("shape"), where)
        size = _dict(raw.get("parameters"), f"{where}: 'parameters'").get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ProtocolError(f"{where}: binary_data_size must be a non-negative integer")
            if header_length is None:
                raise ProtocolError(f"{where}: binary_data_size given without {HEADER_LENGTH}")
            if offset + size > len(body):
                raise ProtocolError(f"{where}: binary data runs past the end of the body")
            array = _from_binary(view[offset : offset + size], datatype, shape, where)
            offset += size
        elif "data" in raw:
            array = _from_json_data(raw["data"], datatype, shape, where)
        else:
            raise ProtocolError(f"{where}: give 'data' or a binary_data_size parameter")
        inputs.append(Tensor(name, datatype, array))
    if header_length is not None and offset != len(body):
        raise ProtocolError(
            f"the body has {len(body) - offset} bytes beyond the inputs' binary_data_size"
        )
    params = _dict(doc.get("parameters"), "'parameters'")
    outputs = {}
    for j, out in enumerate(doc.get("outputs") or []):
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise ProtocolError(f"outputs[{j}] must be an object with a 'name'")
        out_params = _dict(out.get("parameters"), f"outputs[{j}]: 'parameters'")
        outputs[out["name"]] = bool(out_params.get("binary_data", False))
    request_id = doc.get("id")
    return InferRequest(
        inputs=inputs,
        id=str(request_id) if request_id is not None else None,
        parameters=params,
        outputs=outputs,
        binary_output=bool(params.get("binary_data_output", False)),
    )


def encode_request(
    inputs: Iterable[Tensor], binary: bool = False, outputs: dict[str, bool] | None = None
) -> tuple[bytes, int | None]:
    """A request body (client side: tests and the overhead benchmark); returns the body and
    the header length to send (None for pure JSON)."""
    doc: dict[str, Any] = {"inputs": []}
    chunks = []
    for t in inputs:
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": t.shape}
        if binary:
            raw = tensor_bytes(t)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = json_data(t)
        doc["inputs"].append(entry)
    if outputs:
        doc["outputs"] = [{"name": n, "parameters": {"binary_data": b}} for n, b in outputs.items()]
    head = json.dumps(doc, separators=(",", ":")).encode()
    return (head + b"".join(chunks), len(head)) if binary else (head, None)


# ------------------------------------------------------------------------------ responses
def tensor_bytes(t: Tensor) -> bytes:
    """The binary extension's bytes for a tensor (little-endian, row-major)."""
    if t.datatype == BYTES:
        parts = []
        for item in t.array.reshape(-1):
            raw = item.encode() if isinstance(item, str) else bytes(item)
            parts.append(len(raw).to_bytes(4, "little") + raw)
        return b"".join(parts)
    if t.datatype == BF16:
        return float32_to_bf16(t.array).tobytes()
    return np.ascontiguousarray(t.array, dtype=DTYPES[t.datatype]).tobytes()


def json_data(t: Tensor) -> list:
    """A tensor's data as a flat JSON list, row-major."""
    flat = t.array.reshape(-1)
    if t.datatype == BYTES:
        return [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in flat]
    if t.datatype == "FP16":
        flat = flat.astype("<f4")
    return flat.tolist()


def encode_response(
    model: str, version: str, outputs: list[Tensor], request: InferRequest
) -> tuple[bytes, int | None]:
    """The response body and, when any output is binary, its JSON header's length."""
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": []}
    if request.id is not None:
        doc["id"] = request.id
    chunks = []
    for t in outputs:
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": t.shape}
        if request.wants_binary(t.name):
            raw = tensor_bytes(t)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = json_data(t)
        doc["outputs"].append(entry)
    head = json.dumps(doc, separators=(",", ":")).encode()
    if not chunks:
        return head, None
    return head + b"".join(chunks), len(head)


def decode_response(body: bytes, header_length: int | None = None) -> dict[str, np.ndarray]:
    """Outputs by name from a response body (client side: tests and benchmarks)."""
    view = memoryview(body)
    doc = json.loads(bytes(view[:header_length] if header_length else view))
    offset = header_length or len(body)
    result = {}
    for out in doc["outputs"]:
        shape = tuple(out["shape"])
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            result[out["name"]] = _from_binary(view[offset : offset + size], out["datatype"],
                                               shape, out["name"])  # fmt: skip
            offset += size
        else:
            result[out["name"]] = _from_json_data(out["data"], out["datatype"], shape, out["name"])
    return result


def error_body(message: str) -> bytes:
    """The protocol's error object."""
    return json.dumps({"error": message}).encode()
