"""The generative tenant of `gpulens serve`: OpenAI-compatible /v1/completions with a KV cache and
continuous batching, on the CPU with a tiny GPT (seconds).

The served model is a 2-layer GPT whose attention and untied output head are scaled up, so its
greedy output depends on the whole context (a randomly initialised GPT-2 mostly echoes its last
token, which would hide a broken cache or mask). The test holds the very module the server runs.
"""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_server import ServeThread  # noqa: E402

import gpulens.serve.repository as repository  # noqa: E402
from gpulens.serve.models import LastTokenLogits, ServeModelSpec, TensorSpec  # noqa: E402
from gpulens.workloads.models import GPT, GPTConfig  # noqa: E402

CONTEXT = 256


def sharp_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    gpt = GPT(GPTConfig(vocab_size=256, block_size=CONTEXT, n_layer=2, n_head=4, n_embd=64))
    with torch.no_grad():
        gpt.lm_head.weight = nn.Parameter(torch.randn(256, 64))  # untied: no echo of the input
        for block in gpt.blocks:
            block.attn.qkv.weight.normal_(0, 0.5)
            block.attn.proj.weight.normal_(0, 0.5)
        gpt.wpe.weight.normal_(0, 1.0)
    return gpt.eval()


def reference(gpt: GPT, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by full recomputation: the whole sequence through the model per token."""
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            token = int(gpt(torch.tensor([ids]))[0, -1, :256].argmax())
            out.append(token)
            ids.append(token)
    return out


@pytest.fixture(scope="module")
def lm():
    return sharp_gpt()


@pytest.fixture(scope="module")
def srv(tmp_path_factory, lm):
    spec = ServeModelSpec(
        "sharp_gpt",
        (TensorSpec("input_ids", "INT64", (CONTEXT,), max_value=256),),
        (TensorSpec("logits", "FP32", (256,)),),
        lambda: LastTokenLogits(lm),
        generative=True,
    )
    real = repository.get_serve_model
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(repository, "get_serve_model", lambda n: spec if n == "lm" else real(n))
        runs = tmp_path_factory.mktemp("runs")
        with ServeThread(runs, models=("lm", "identity"), max_batch=4) as server:
            yield server


def post(srv, doc, timeout=60):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(doc).encode(),
                     {"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def events(body: bytes) -> list:
    """The SSE payloads: dicts, and the string "[DONE]"."""
    blocks = body.decode().split("\n\n")
    assert blocks[-1] == "", "the stream must end with a blank line"
    out = []
    for block in blocks[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def streamed_ids(evs: list) -> list[int]:
    return [t for e in evs if isinstance(e, dict) and e["choices"]
            for t in e["choices"][0]["token_ids"]]  # fmt: skip


def stream_doc(prompt, max_tokens, **kw):
    return {"model": "lm", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True, **kw}  # fmt: skip


def test_sse_stream_format_ends_with_done(srv):
    status, ctype, body = post(srv, {"model": "lm", "prompt": "Hello, world", "max_tokens": 6,
                                     "temperature": 0, "stream": True,
                                     "stream_options": {"include_usage": True}})  # fmt: skip
    assert status == 200 and ctype.startswith("text/event-stream")
    evs = events(body)
    assert evs[-1] == "[DONE]" and "[DONE]" not in evs[:-1]
    chunks, usage = evs[:-2], evs[-2]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18}  # fmt: skip
    for c in chunks:
        assert c["object"] == "text_completion" and c["model"] == "lm"
        assert isinstance(c["choices"][0]["text"], str)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


def test_greedy_stream_equals_a_full_recompute_loop(srv, lm):
    prompt = list(range(40, 57))
    want = reference(lm, prompt, 40)
    status, _, body = post(srv, stream_doc(prompt, 40))
    assert status == 200
    assert streamed_ids(events(body)) == want
    # the same tokens without streaming, with the usage and the byte-level text
    status, ctype, body = post(srv, {"model": "lm", "prompt": prompt, "max_tokens": 40,
                                     "temperature": 0, "return_token_ids": True})  # fmt: skip
    doc = json.loads(body)
    assert status == 200 and ctype.startswith("application/json")
    choice = doc["choices"][0]
    assert choice["token_ids"] == want and choice["finish_reason"] == "length"
    assert choice["text"] == bytes(want).decode("utf-8", errors="replace")
    assert doc["usage"] == {"prompt_tokens": 17, "completion_tokens": 40, "total_tokens": 57}


def batch_sizes(srv) -> tuple[float, float]:
    """(iterations with one sequence, all iterations) of the served LM so far."""
    m = srv.metrics()
    one = m['gpulens_serve_generation_batch_size_bucket{model="lm",le="1"}']
    return one, m['gpulens_serve_generation_batch_size_count{model="lm"}']


def test_concurrent_requests_of_different_lengths_share_iterations(srv, lm):
    first_prompt, second_prompt = list(range(60, 90)), [7, 200, 31]
    one_before, all_before = batch_sizes(srv)
    # the first streams; the second is sent once the first is generating and outlives it, so
    # it moves into the first one's slot when that one ends (the cache compaction)
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(stream_doc(first_prompt, 100)).encode(),
                 {"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    head = resp.readline()
    assert head.startswith(b"data: ")
    result = {}
    second = threading.Thread(
        target=lambda: result.update(second=post(srv, stream_doc(second_prompt, 150)))
    )
    second.start()
    rest = resp.read()
    conn.close()
    second.join(60)
    assert streamed_ids(events(head + rest)) == reference(lm, first_prompt, 100)
    status, _, body = result["second"]
    assert status == 200 and streamed_ids(events(body)) == reference(lm, second_prompt, 150)
    one_after, all_after = batch_sizes(srv)
    shared = (all_after - all_before) - (one_after - one_before)
    assert shared >= 1, "no iteration ran both sequences"


@pytest.mark.parametrize(
    "doc, param",
    [
        ({"model": "lm"}, "prompt"),
        ({"model": "lm", "prompt": ""}, "prompt"),
        ({"model": "lm", "prompt": [1, 999]}, "prompt"),
        ({"model": "lm", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "lm", "prompt": "x", "temperature": 5}, "temperature"),
        ({"model": "lm", "prompt": "x", "n": 2}, "n"),
        ({"model": "lm", "prompt": "x", "max_tokens": CONTEXT}, "max_tokens"),
        ({"prompt": "x"}, "model"),
    ],
)
def test_bad_requests_get_400_in_openai_error_json(srv, doc, param):
    status, ctype, body = post(srv, doc)
    assert status == 400 and ctype.startswith("application/json")
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_malformed_json_is_400_and_unknown_models_are_404(srv):
    status, body = srv.request("POST", "/v1/completions", b"{not json")[::2]
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    for name in ("nope", "identity"):  # identity is served, but is no language model
        status, _, body = post(srv, {"model": name, "prompt": "x"})
        err = json.loads(body)["error"]
        assert status == 404 and err["code"] == "model_not_found" and name in err["message"]
    assert srv.get("/v1/models") == (200, {"object": "list", "data": [
        {"id": "lm", "object": "model", "created": 0, "owned_by": "gpulens",
         "max_model_len": CONTEXT}]})  # fmt: skip
    assert post(srv, stream_doc("still serving", 2))[0] == 200


def test_a_client_that_goes_away_frees_its_slot(srv):
    def cancelled() -> float:
        return srv.metrics()[
            'gpulens_serve_completions_total{model="lm",finish_reason="cancelled"}'
        ]

    before = cancelled()
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    conn.request("POST", "/v1/completions",
                 json.dumps(stream_doc([1, 2, 3], CONTEXT - 3)).encode())  # fmt: skip
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")
    conn.sock.close()  # gone mid-stream
    conn.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = srv.metrics()
        if cancelled() > before and m['gpulens_serve_active_sequences{model="lm"}'] == 0:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the cancelled sequence kept its slot")
    assert post(srv, stream_doc("after", 3))[0] == 200


def test_gpulens_load_openai_reports_ttft_and_tpot(srv, capsys):
    pytest.importorskip("aiohttp")
    from gpulens.cli import main

    code = main(["load", "--url", srv.url, "--tenant", "lm:rate=8", "--openai", "lm",
                 "--prompt-tokens", "4", "--max-tokens", "12", "--duration", "1.5",
                 "--warmup", "0.3", "--json", "--no-store"])  # fmt: skip
    cap = capsys.readouterr()
    assert code == 0, cap.err
    (t,) = json.loads(cap.out)["tenants"]
    assert t["errors"]["count"] == 0 and t["requests"] >= 5
    assert 0 < t["ttft_ms"]["p50"] <= t["latency_ms"]["p50"]
    assert 0 < t["tpot_ms"]["p50"] < t["latency_ms"]["p50"]
    server = json.loads(cap.out)["server"]["models"]["lm"]
    assert server["requests"] >= 5  # the generative requests count in Triton's counters too


def test_the_serving_run_records_the_generative_tenant(tmp_path):
    with ServeThread(tmp_path, models=("gpt_tiny",), max_batch=2) as srv:
        m = srv.metrics()
        for i in range(3):
            doc = {"model": "gpt_tiny", "prompt": f"prompt {i}", "max_tokens": 5, "stream": True}
            assert post(srv, doc)[0] == 200
        m = srv.metrics()
        assert m['gpulens_serve_generation_tokens_total{model="gpt_tiny"}'] == 15
        assert m['gpulens_serve_time_to_first_token_seconds_count{model="gpt_tiny"}'] == 3
        assert m['gpulens_serve_generation_queue_length{model="gpt_tiny"}'] == 0
    out = srv.outcome
    meta = json.loads((out.result.record_dir / "run.json").read_text())
    (gen_cfg,) = meta["effective_config"]["generative"]
    assert gen_cfg["name"] == "gpt_tiny" and gen_cfg["context_tokens"] == 256
    assert gen_cfg["tokenizer"].startswith("byte-level")
    gen = meta["summary"]["models"]["gpt_tiny"]["generation"]
    assert gen["generated_tokens"] == 15 and gen["completions"]["length"] == 3
    assert gen["ttft_ms"]["p50"] > 0 and gen["tpot_ms"]["p50"] > 0 and gen["tokens_per_s"] > 0
    from gpulens.record.reader import read_record

    rows = read_record(out.result.record_dir).series("generations")
    assert len(rows) == 3 and (rows["completion_tokens"] == 5).all()
    assert (rows["ttft_ms"] <= rows["latency_ms"]).all() and (rows["prompt_tokens"] == 8).all()


@pytest.mark.slow
def test_schemathesis_finds_nothing_against_the_completions_endpoint(tmp_path):
    pytest.importorskip("schemathesis")
    cli = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    with ServeThread(tmp_path / "runs", models=("gpt_tiny",), max_batch=4, max_body_mb=1) as srv:
        out = subprocess.run(
            [cli, "run", f"{srv.url}/v2/openapi.json", "--checks", "all",
             "--exclude-checks", "positive_data_acceptance", "--include-path-regex", "^/v1/",
             "--max-examples", "25", "--max-time", "20", "--seed", "1",
             "--report-dir", str(tmp_path / "report")],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip
        assert post(srv, {"model": "gpt_tiny", "prompt": "ok", "max_tokens": 2})[0] == 200
    assert out.returncode == 0, out.stdout[-4000:]
