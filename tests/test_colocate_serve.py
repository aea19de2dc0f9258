"""serve: jobs of `gpulens colocate`: a `gpulens serve` process as a tenant beside other jobs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpulens.cli import main
from gpulens.errors import UsageError
from gpulens.serve.load_report import ERR_TIMEOUT, LoadRecords
from gpulens.workloads.colocate_serve import REQUEST_TIMEOUT_S, job_result
from gpulens.workloads.jobspec import parse_job


def test_serve_jobs_parse_and_check_their_options():
    j = parse_job("serve:bert-base:rate=50,slo_ms=40,arrivals=poisson")
    assert (j.kind, j.workload, j.rate_per_s, j.slo_ms, j.batch_size) == (
        "serve", "bert-base", 50.0, 40.0, 1)  # fmt: skip
    assert j.name == "serve-bert-base" and not j.builtin  # its own process: never under streams
    assert j.key == "serve:bert-base:batch=1,precision=fp32,rate=50,arrivals=poisson"
    # written as gpulens load --tenant is: colons between the options, arrival= for arrivals=
    assert parse_job("serve:bert-base:rate=50:slo_ms=40:arrival=poisson") == j
    with pytest.raises(UsageError, match="needs rate=R"):
        parse_job("serve:resnet50")
    with pytest.raises(UsageError, match="unknown model 'nosuch' for gpulens serve"):
        parse_job("serve:nosuch:rate=5")
    with pytest.raises(UsageError, match="slo_ms= is for infer: and serve: jobs"):
        parse_job("resnet18:slo_ms=50")


def _records(latency_ms: list[float], status: list[int]) -> LoadRecords:
    n = len(latency_ms)
    scheduled = np.arange(n) * 0.1
    done = scheduled + np.asarray(latency_ms) / 1e3
    done[np.asarray(status) <= 0] = np.nan  # no answer
    return LoadRecords(tenant=np.zeros(n, dtype=np.int32), scheduled_s=scheduled,
                       sent_s=scheduled, done_s=done, status=np.asarray(status),
                       warmup_s=0.0, duration_s=n * 0.1)  # fmt: skip


def test_a_failed_request_is_an_slo_miss_at_the_timeout():
    job = parse_job("serve:identity:rate=10,slo_ms=50,batch=2")
    rec = _records([10, 20, 30, 80, 5], [200, 200, 503, 200, ERR_TIMEOUT])
    r = job_result(job, rec, window_s=0.5)
    assert r["steps"] == 5 and r["requests_failed"] == 2
    assert r["samples"] == 3 * 2 and r["throughput_samples_per_s"] == pytest.approx(12.0)
    # the two failures count as the timeout: within 50 ms only the 10 and 20 ms answers
    assert r["step_times_s"] == pytest.approx([0.01, 0.02, REQUEST_TIMEOUT_S, 0.08,
                                              REQUEST_TIMEOUT_S])  # fmt: skip
    assert r["error"] is None  # a miss, not a failed job


@pytest.mark.slow
def test_a_served_tenant_beside_training_on_the_cpu(capsys, gpulens_home):
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    code = main(["colocate", "tiny_cnn:batch=8", "serve:identity:rate=20,slo_ms=200",
                 "--mechanisms", "time-slice,streams", "--device", "cpu", "--duration", "2",
                 "--warmup-s", "0.5", "--no-store", "--json"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)
    served = next(j for j in doc["jobs"] if j["kind"] == "serve")
    # 20 requests/s, constant arrivals, answered far within the window: all of them
    assert served["throughput_alone"] == pytest.approx(20.0, rel=0.1)
    by_mech = {r["mechanism"]: r for r in doc["results"]}
    ts = {j["name"]: j for j in by_mech["time-slice"]["jobs"]}
    assert ts["serve-identity"]["slo_ms"] == 200 and ts["serve-identity"]["slo_attainment"] > 0.9
    assert ts["serve-identity"]["slo_attainment_lost_pp"] is not None
    assert ts["tiny_cnn"]["throughput_together"] > 0
    assert by_mech["streams"]["status"] == "unavailable"


def test_without_the_serve_extra_a_serve_job_is_one_line_naming_it(capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "uvicorn", None)  # as if not installed
    code = main(["colocate", "tiny_cnn", "serve:identity:rate=5", "--device", "cpu", "--no-store"])
    err = capsys.readouterr().err
    assert code == 2 and "gpulens[serve]" in err and len(err.strip().splitlines()) == 1
