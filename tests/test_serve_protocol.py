"""The KServe v2 codec: JSON tensors, the binary tensor data extension, and its errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpulens.serve.protocol import (
    InferRequest,
    ProtocolError,
    Tensor,
    bf16_to_float32,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
    float32_to_bf16,
    parse_header_length,
)

ARRAYS = {
    "FP32": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    "FP16": (np.arange(6, dtype=np.float16) / 3).reshape(2, 3),
    "INT64": np.array([[1, -2, 3], [2**40, 0, -(2**40)]], dtype=np.int64),
    "INT32": np.array([7, -8, 9], dtype=np.int32),
    "UINT8": np.array([[0, 255]], dtype=np.uint8),
    "BOOL": np.array([True, False, True]),
    "FP64": np.array([1e-300, 2.5]),
}


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("datatype", sorted(ARRAYS))
def test_a_tensor_survives_the_round_trip(datatype, binary):
    array = ARRAYS[datatype]
    body, header = encode_request([Tensor("x", datatype, array)], binary=binary)
    assert (header is not None) == binary
    if binary:  # the JSON header is followed by exactly the tensor's little-endian bytes
        assert body[header:] == array.astype(array.dtype.newbyteorder("<")).tobytes()
        assert json.loads(body[:header])["inputs"][0]["parameters"] == {
            "binary_data_size": array.nbytes
        }
    req = decode_request(body, header)
    (t,) = req.inputs
    assert t.name == "x" and t.datatype == datatype and t.shape == list(array.shape)
    np.testing.assert_array_equal(t.array, array)


@pytest.mark.parametrize("binary", [False, True])
def test_bytes_tensors_are_length_prefixed_in_binary(binary):
    array = np.array([b"ab", b"", "caf\u00e9".encode()], dtype=object)
    body, header = encode_request([Tensor("s", "BYTES", array)], binary=binary)
    if binary:
        assert body[header:] == b"\x02\x00\x00\x00ab\x00\x00\x00\x00\x05\x00\x00\x00caf\xc3\xa9"
    (t,) = decode_request(body, header).inputs
    assert list(t.array) == list(array)


def test_bf16_is_widened_exactly_and_rounded_to_nearest_even():
    values = np.array([1.0, -2.5, 3.140625, 2.0**100], dtype=np.float32)
    bits = float32_to_bf16(values)
    np.testing.assert_array_equal(bf16_to_float32(bits), values)  # all exact in bf16
    assert float32_to_bf16(np.array([1.00390625], np.float32))[0] == 0x3F80  # tie -> even
    head = json.dumps({"inputs": [{"name": "b", "datatype": "BF16", "shape": [4],
                                   "parameters": {"binary_data_size": 8}}]}).encode()  # fmt: skip
    (t,) = decode_request(head + bits.tobytes(), len(head)).inputs
    np.testing.assert_array_equal(t.array, values)


def test_several_inputs_mix_json_and_binary_in_order():
    a, b = np.arange(4, dtype=np.float32), np.arange(3, dtype=np.int64)
    doc = {"id": "r1", "inputs": [
        {"name": "a", "datatype": "FP32", "shape": [4], "parameters": {"binary_data_size": 16}},
        {"name": "j", "datatype": "INT32", "shape": [2, 1], "data": [[5], [6]]},  # nested data
        {"name": "b", "datatype": "INT64", "shape": [3], "parameters": {"binary_data_size": 24}},
    ], "outputs": [{"name": "y", "parameters": {"binary_data": True}}, {"name": "z"}]}  # fmt: skip
    head = json.dumps(doc).encode()
    req = decode_request(head + a.tobytes() + b.tobytes(), len(head))
    assert [t.name for t in req.inputs] == ["a", "j", "b"]
    np.testing.assert_array_equal(req.inputs[0].array, a)
    np.testing.assert_array_equal(req.inputs[1].array, [[5], [6]])
    np.testing.assert_array_equal(req.inputs[2].array, b)
    assert req.id == "r1" and req.wants_binary("y") and not req.wants_binary("z")


def test_responses_are_binary_only_where_asked():
    y = np.arange(6, dtype=np.float32).reshape(2, 3)
    z = np.array([1, 2], dtype=np.int64)
    outputs = [Tensor("y", "FP32", y), Tensor("z", "INT64", z)]
    # per output
    req = InferRequest(inputs=[], id="7", outputs={"y": True, "z": False})
    body, header = encode_response("m", "1", outputs, req)
    doc = json.loads(body[:header])
    assert doc["id"] == "7" and doc["model_name"] == "m" and doc["model_version"] == "1"
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": 24}
    assert doc["outputs"][1]["data"] == [1, 2] and body[header:] == y.tobytes()
    got = decode_response(body, header)
    np.testing.assert_array_equal(got["y"], y)
    np.testing.assert_array_equal(got["z"], z)
    # the request-wide parameter, and plain JSON
    body, header = encode_response("m", "1", outputs, InferRequest([], binary_output=True))
    assert len(body) - header == y.nbytes + z.nbytes
    body, header = encode_response("m", "1", outputs, InferRequest([]))
    assert header is None and json.loads(body)["outputs"][0]["data"] == y.ravel().tolist()


def _json_input(**fields):
    entry = {"name": "x", "datatype": "FP32", "shape": [2], "data": [1, 2], **fields}
    return json.dumps({"inputs": [entry]}).encode()


@pytest.mark.parametrize(
    ("body", "header", "message"),
    [
        (b"{not json", None, "malformed JSON"),
        (b"[1, 2]", None, "JSON object"),
        (b'{"inputs": []}', None, "non-empty list"),
        (_json_input(datatype="FP8"), None, "unknown datatype 'FP8'"),
        (_json_input(datatype={}), None, "unknown datatype {}"),  # found by schemathesis
        (_json_input(shape=[3]), None, "has 2 elements but shape [3] needs 3"),
        (_json_input(shape=[-1, 2]), None, "non-negative integers"),
        (_json_input(shape="2"), None, "non-negative integers"),
        (_json_input(data="12"), None, "JSON array"),
        (_json_input(data=["a", "b"]), None, "does not hold FP32"),
        (_json_input(data=[[1], [2, 3]]), None, "does not hold FP32"),  # ragged
        (_json_input(datatype="INT8", data=[1, 1000]), None, "does not hold INT8"),
        (_json_input(parameters={"binary_data_size": 8}), None, "without"),
    ],
)
def test_bad_requests_are_400_with_a_message(body, header, message):
    with pytest.raises(ProtocolError) as info:
        decode_request(body, header)
    assert info.value.status == 400
    assert message in str(info.value)


def test_binary_sizes_must_add_up():
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [4],
                                   "parameters": {"binary_data_size": 16}}]}).encode()  # fmt: skip
    payload = np.zeros(4, np.float32).tobytes()
    with pytest.raises(ProtocolError, match="past the end"):
        decode_request(head + payload[:8], len(head))
    with pytest.raises(ProtocolError, match="4 bytes beyond"):
        decode_request(head + payload + b"xxxx", len(head))
    wrong = head.replace(b'"binary_data_size": 16', b'"binary_data_size": 12')
    with pytest.raises(ProtocolError, match="needs 16"):
        decode_request(wrong + payload[:12], len(wrong))
    with pytest.raises(ProtocolError, match="must be an integer"):
        parse_header_length("abc", 10)
    with pytest.raises(ProtocolError, match="the body has 10 bytes"):
        parse_header_length("11", 10)
    assert parse_header_length(None, 10) is None and parse_header_length("10", 10) == 10
