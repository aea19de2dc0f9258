"""`gpulens serve` end to end on a loopback port (CPU): health, metadata, JSON and binary
inference, the 4xx cases (after which it still serves), 503 + Retry-After under overload,
/metrics, the official tritonclient, and the finished run record."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_server import ServeThread  # noqa: E402

from gpulens.serve.protocol import HEADER_LENGTH, Tensor, decode_response, encode_request  # noqa: E402

ROW = [float(i) / 4 for i in range(16)]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with ServeThread(tmp_path_factory.mktemp("runs"), max_body_mb=1, max_batch=8) as server:
        yield server
    assert server.outcome.result.status == "finished"


def identity_request(rows=1):
    return {"inputs": [{"name": "input", "datatype": "FP32", "shape": [rows, 16],
                        "data": ROW * rows}]}  # fmt: skip


def test_health_and_metadata(srv):
    assert srv.get("/v2/health/live") == (200, {"live": True})
    assert srv.get("/v2/health/ready") == (200, {"ready": True})
    status, meta = srv.get("/v2")
    assert (
        status == 200 and meta["name"] == "gpulens" and "binary_tensor_data" in meta["extensions"]
    )
    status, model = srv.get("/v2/models/tiny_cnn")
    assert status == 200 and model["name"] == "tiny_cnn" and model["versions"] == ["1"]
    assert model["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 64, 64]}]
    assert model["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]
    assert srv.get("/v2/models/identity/ready") == (200, {"name": "identity", "ready": True})
    assert srv.get("/v2/models/identity/versions/1")[1]["name"] == "identity"
    assert srv.get("/v2/models/identity/config")[1]["max_batch_size"] == 8
    status, err = srv.get("/v2/models/identity/versions/2")
    assert status == 404 and "no version '2'" in err["error"]


def test_json_inference_returns_the_right_shapes_and_values(srv):
    status, headers, body = srv.infer("identity", {**identity_request(3), "id": "abc"})
    assert status == 200 and headers["content-type"].startswith("application/json")
    doc = json.loads(body)
    assert doc["model_name"] == "identity" and doc["id"] == "abc"
    (out,) = doc["outputs"]
    assert out == {"name": "output", "datatype": "FP32", "shape": [3, 16], "data": ROW * 3}
    images = np.random.default_rng(0).standard_normal((2, 3, 64, 64)).astype(np.float32)
    req = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 3, 64, 64],
                       "data": images.ravel().tolist()}]}  # fmt: skip
    status, _, body = srv.infer("tiny_cnn", req)
    (out,) = json.loads(body)["outputs"]
    assert status == 200 and out["name"] == "logits" and out["shape"] == [2, 10]
    assert np.all(np.isfinite(out["data"])) and len(out["data"]) == 20


def test_binary_inference_in_and_out(srv):
    x = np.random.default_rng(1).standard_normal((5, 16)).astype(np.float32)
    body, header = encode_request([Tensor("input", "FP32", x)], binary=True,
                                  outputs={"output": True})  # fmt: skip
    status, headers, resp = srv.infer("identity", body, {HEADER_LENGTH: str(header)})
    assert status == 200 and headers["content-type"] == "application/octet-stream"
    length = int(headers[HEADER_LENGTH.lower()])
    assert resp[length:] == x.tobytes()  # the output's raw bytes after the JSON header
    np.testing.assert_array_equal(decode_response(resp, length)["output"], x)
    # binary in, JSON out (no output asked as binary)
    body, header = encode_request([Tensor("input", "FP32", x)], binary=True)
    status, headers, resp = srv.infer("identity", body, {HEADER_LENGTH: str(header)})
    assert status == 200 and HEADER_LENGTH.lower() not in headers
    np.testing.assert_allclose(json.loads(resp)["outputs"][0]["data"], x.ravel())


@pytest.mark.parametrize(
    ("model", "body", "status", "message"),
    [
        ("identity", b"{oops", 400, "malformed JSON"),
        ("identity", {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 15],
                                  "data": ROW[:15]}]}, 400, "has shape [-1, 16], got [1, 15]"),
        ("identity", {"inputs": [{"name": "input", "datatype": "INT64", "shape": [1, 16],
                                  "data": list(range(16))}]}, 400, "is FP32, got INT64"),
        ("identity", {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16],
                                  "data": ROW}]}, 400, "takes one input 'input'"),
        ("identity", identity_request(9), 400, "exceeds --max-batch 8 of model 'identity'"),
        ("identity", {**identity_request(), "outputs": [{"name": "nope"}]}, 400, "no output"),
        ("nope", identity_request(), 404, "unknown model 'nope'"),
        ("identity", b"x" * 1_100_000, 413, "exceeds the server's limit"),
    ],
)  # fmt: skip
def test_bad_requests_get_4xx_json_errors_and_the_server_keeps_serving(
    srv, model, body, status, message
):
    got, headers, resp = srv.infer(model, body)
    assert got == status and headers["content-type"] == "application/json"
    assert message in json.loads(resp)["error"]
    assert srv.infer("identity", identity_request())[0] == 200


def test_unknown_routes_and_methods_answer_in_the_protocols_error_format(srv):
    status, err = srv.get("/v2/nothing/here")
    assert status == 404 and "error" in err
    status, _, body = srv.request("GET", "/v2/models/identity/infer")
    assert status == 405 and "error" in json.loads(body)


def test_metrics_counters_move(srv):
    before = srv.metrics()
    ok = 'model="identity",version="1"'
    for rows in (1, 2, 3):
        assert srv.infer("identity", identity_request(rows))[0] == 200
    assert srv.infer("identity", b"{bad")[0] == 400
    after = srv.metrics()

    def delta(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    assert delta(f"nv_inference_request_success{{{ok}}}") == 3
    assert delta(f"nv_inference_count{{{ok}}}") == 6  # samples
    assert 1 <= delta(f"nv_inference_exec_count{{{ok}}}") <= 3
    assert delta('nv_inference_request_failure{model="identity",reason="OTHER",version="1"}') == 1
    for name in ("request", "queue", "compute_infer"):
        assert delta(f"nv_inference_{name}_duration_us{{{ok}}}") >= 0
    assert delta(f"nv_inference_request_duration_us{{{ok}}}") > 0
    assert delta('gpulens_serve_batch_size_count{model="identity"}') == delta(
        f"nv_inference_exec_count{{{ok}}}"
    )
    assert after['gpulens_serve_queue_depth{model="identity"}'] == 0
    assert (
        after['gpulens_serve_batch_size_bucket{model="identity",le="+Inf"}']
        == after['gpulens_serve_batch_size_count{model="identity"}']
    )


def test_the_official_tritonclient_talks_to_it(srv):
    httpclient = pytest.importorskip("tritonclient.http")
    client = httpclient.InferenceServerClient(url=f"{srv.host}:{srv.port}")
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny_cnn")
    meta = client.get_model_metadata("tiny_cnn")
    assert meta["inputs"][0]["shape"] == [-1, 3, 64, 64]
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    x = np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)
    for binary in (True, False):
        inp = httpclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        outputs = [httpclient.InferRequestedOutput("output", binary_data=binary)]
        result = client.infer("identity", [inp], outputs=outputs)
        np.testing.assert_array_equal(result.as_numpy("output"), x)
    images = np.zeros((3, 3, 64, 64), np.float32)
    inp = httpclient.InferInput("input", list(images.shape), "FP32")
    inp.set_data_from_numpy(images)
    assert client.infer("tiny_cnn", [inp]).as_numpy("logits").shape == (3, 10)
    with pytest.raises(Exception, match="unknown model"):
        client.get_model_metadata("nope")
    client.close()


def test_overload_answers_503_with_retry_after_and_never_crashes(tmp_path):
    images = np.zeros((16, 3, 64, 64), np.float32)
    body, header = encode_request([Tensor("input", "FP32", images)], binary=True)
    headers = {HEADER_LENGTH: str(header)}
    with ServeThread(tmp_path, models=("tiny_cnn",), max_batch=1, max_queue=1) as srv:
        go = threading.Barrier(24)

        def one(_):
            go.wait()
            return srv.infer("tiny_cnn", body, headers)

        with ThreadPoolExecutor(24) as pool:
            results = list(pool.map(one, range(24)))
        codes = [r[0] for r in results]
        refused = [r for r in results if r[0] == 503]
        assert set(codes) <= {200, 503} and codes.count(200) >= 2 and refused
        for _, h, b in refused:
            assert h["retry-after"] == "1" and "queue full" in json.loads(b)["error"]
        m = srv.metrics()
        assert m['gpulens_serve_rejected_total{model="tiny_cnn"}'] == len(refused)
        assert m['nv_inference_request_failure{model="tiny_cnn",reason="REJECTED",version="1"}'] \
            == len(refused)  # fmt: skip
        assert srv.infer("tiny_cnn", body, headers)[0] == 200  # still serving
    summary = srv.outcome.summary
    assert summary["rejected_503"] == len(refused)
    assert summary["models"]["tiny_cnn"]["requests"] == codes.count(200) + 1


def test_the_serving_run_is_a_finished_record_with_a_summary(tmp_path):
    with ServeThread(tmp_path, models=("identity", "a=identity"), max_batch=4) as srv:
        for _ in range(5):
            assert srv.infer("identity", identity_request(2))[0] == 200
        assert srv.infer("a", identity_request())[0] == 200
    out = srv.outcome
    meta = json.loads((out.result.record_dir / "run.json").read_text())
    assert meta["kind"] == "serve" and meta["status"] == "finished"
    assert meta["effective_config"]["device"] == "cpu"
    assert [m["name"] for m in meta["effective_config"]["models"]] == ["identity", "a"]
    s = meta["summary"]
    assert s["requests"] == 6 and s["models"]["identity"]["requests"] == 5
    assert s["models"]["identity"]["inferences"] == 10 and s["models"]["a"]["requests"] == 1
    assert s["models"]["identity"]["queue_ms"]["p50"] is not None
    assert s["stop_reason"] == "stop" and s["mean_batch_size"] >= 1
    doc = out.document()
    assert doc["status"] == "finished" and doc["url"].startswith("http://127.0.0.1:")
    assert doc["max_batch"] == 4 and doc["requests"] == 6
    # the batches series: one row per execution; their sizes add up to the inferences
    from gpulens.record.reader import read_record

    record = read_record(out.result.record_dir)
    batches = record.series("batches")
    per_model = batches.groupby("model")["batch_size"].sum().to_dict()
    assert per_model == {"identity": 10, "a": 1}
    assert len(batches) == s["models"]["identity"]["executions"] + s["models"]["a"]["executions"]
    assert (batches["batch_size"] <= 4).all() and batches["ok"].all()
    assert (batches["compute_ms"] >= batches["infer_ms"]).all()
    pytest.importorskip("plotly")
    from gpulens.report.document import build_report

    (section,) = build_report([record])
    assert dict(section.facts)["dynamic batching"] == "max batch 4, queue delay 0.0 ms"
    assert len(section.figures) >= 1  # the batch sizes served
