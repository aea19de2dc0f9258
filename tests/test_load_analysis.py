"""gpulens load without a server: the schedule, the tenant specs, the report's arithmetic on
hand-made records, the /metrics deltas and the request bodies."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from gpulens.errors import UsageError
from gpulens.serve import load_report as lr
from gpulens.serve.load_config import LoadConfig, TenantSpec, parse_sweep
from gpulens.serve.load_inputs import BINARY_HEADER, concrete_shape, kserve_request
from gpulens.serve.load_search import find_max
from gpulens.serve.loadgen import arrival_times, merged_schedule

FIXTURES = Path(__file__).parent / "fixtures" / "triton_metrics"


# ------------------------------------------------------------------------------ schedule
def test_poisson_schedule_has_the_rate_and_exponential_gaps():
    spec = TenantSpec("m", rate_rps=500.0)
    t = arrival_times(spec, 20.0, np.random.default_rng([7, 0]))
    assert t.min() > 0 and t.max() < 20.0 and np.all(np.diff(t) >= 0)
    assert t.size / 20.0 == pytest.approx(500.0, rel=0.03)  # 10,000 expected, sd 1%
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: cv = 1
    again = arrival_times(spec, 20.0, np.random.default_rng([7, 0]))
    assert np.array_equal(t, again)  # seeded: repeatable


def test_constant_schedule_is_evenly_spaced():
    t = arrival_times(TenantSpec("m", 40.0, arrival="constant"), 2.0, np.random.default_rng(0))
    assert t.size == 80 and t[0] == 0.0
    assert np.allclose(np.diff(t), 0.025)


def test_merged_schedule_is_one_clock_over_all_tenants():
    tenants = (TenantSpec("a", 300.0), TenantSpec("b", 100.0, arrival="constant"))
    times, owners = merged_schedule(tenants, 5.0, seed=3)
    assert np.all(np.diff(times) >= 0)  # one ordering for everyone
    assert set(owners.tolist()) == {0, 1}
    assert (owners == 1).sum() == 500
    assert (owners == 0).sum() == pytest.approx(1500, rel=0.1)
    # each tenant draws its own stream: adding a tenant leaves the first one's arrivals alone
    alone, _ = merged_schedule(tenants[:1], 5.0, seed=3)
    assert np.array_equal(alone, times[owners == 0])
    other, _ = merged_schedule(tenants[:1], 5.0, seed=4)
    assert not np.array_equal(alone[:10], other[:10])


# ------------------------------------------------------------------------------ config
def test_tenant_spec_parses_every_option():
    t = TenantSpec.parse("resnet50:rate=100:slo_ms=50:arrival=constant:batch=4")
    assert (t.model, t.rate_rps, t.slo_ms, t.arrival, t.batch) == (
        "resnet50", 100.0, 50.0, "constant", 4,
    )  # fmt: skip
    assert TenantSpec.parse("bert:rate=2.5").slo_ms is None


def test_tenant_options_may_be_split_by_commas_as_colocate_writes_them():
    colons = TenantSpec.parse("resnet50:rate=100:slo_ms=50:arrival=constant:batch=4")
    assert TenantSpec.parse("resnet50:rate=100,slo_ms=50,arrivals=constant,batch=4") == colons
    assert TenantSpec.parse("resnet50:rate=100,slo_ms=50:arrival=constant, batch=4") == colons
    with pytest.raises(UsageError) as bad:
        TenantSpec.parse("resnet50:rate=100;slo_ms=50")
    assert "MODEL:rate=R[:slo_ms=S]" in str(bad.value)  # the accepted form
    with pytest.raises(UsageError) as bad:
        TenantSpec.parse("resnet50:rate=100,slo=50")
    assert "resnet50:rate=100,slo_ms=50" in str(bad.value)  # both separators, by example


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("resnet50:rate=abc", "not a number"),
        ("resnet50:rate=-1", "rate must be > 0"),
        ("resnet50:rate=10:slo=5", "cannot read 'slo=5'"),
        ("resnet50:rate=10:arrival=bursty", "arrival='bursty'"),
        ("resnet50:rate=10:batch=0", "batch must be 1 or more"),
        (":rate=10", "give a model name"),
    ],
)
def test_bad_tenant_specs_name_the_fix(spec, fragment):
    with pytest.raises(UsageError, match=fragment):
        TenantSpec.parse(spec)


def test_load_config_checks():
    t = (TenantSpec("a", 1.0),)
    with pytest.raises(UsageError, match="--url"):
        LoadConfig(url="localhost:8000", tenants=t)
    with pytest.raises(UsageError, match="once"):
        LoadConfig(url="http://x", tenants=t * 2)
    with pytest.raises(UsageError, match="needs an SLO"):
        LoadConfig(url="http://x", tenants=t, scenario="server")
    assert LoadConfig(url="http://x/", tenants=t).url == "http://x"
    assert parse_sweep("a:rates=10,20,40") == ("a", "rates", (10.0, 20.0, 40.0))
    assert parse_sweep("a:concurrency=1,4") == ("a", "concurrency", (1.0, 4.0))
    with pytest.raises(UsageError, match="rates="):
        parse_sweep("a:10,20")
    with pytest.raises(UsageError, match="integers"):
        parse_sweep("a:concurrency=1.5")
    # a tenant without a rate is for a closed loop only
    no_rate = (TenantSpec.parse("a"),)
    with pytest.raises(UsageError, match="give a rate"):
        LoadConfig(url="http://x", tenants=no_rate)
    assert LoadConfig(url="http://x", tenants=no_rate, concurrency=2).concurrency == 2
    with pytest.raises(UsageError, match="--concurrency must be 1 or more"):
        LoadConfig(url="http://x", tenants=t, concurrency=0)
    with pytest.raises(UsageError, match="drop --scenario"):
        LoadConfig(url="http://x", tenants=t, concurrency=2, scenario="offline")


def test_a_generator_behind_schedule_still_lets_the_loop_read_responses():
    """Each send costs more than the gap to the next arrival, so the generator is always
    behind: it must still yield to the event loop between bursts (where responses are read
    and their completion times taken), not only once the whole schedule has left."""
    import asyncio
    import time
    from types import SimpleNamespace

    from gpulens.serve.loadgen import _Driver

    config = LoadConfig(url="http://x", tenants=(TenantSpec("m", 1000.0),))
    driver = _Driver(config, None, SimpleNamespace(ClientTimeout=lambda total: None), [b""])

    def slow_start(i: int) -> None:  # 40 us per send, arrivals 10 us apart
        end = time.perf_counter() + 4e-5
        while time.perf_counter() < end:
            pass
        driver.started = i + 1

    driver._start = slow_start
    n = 2000
    times, owners = np.arange(n) * 1e-5, np.zeros(n, dtype=np.int32)

    async def main() -> int:
        turns = 0

        async def other_work() -> None:  # stands for the responses waiting to be read
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.get_running_loop().create_task(other_work())
        await asyncio.sleep(0)
        before = turns
        await driver.open_loop(times, owners)
        task.cancel()
        return turns - before

    assert asyncio.run(main()) >= 3
    assert driver.started == n


def _counting(coro, resumes: list[int]):
    """``coro`` run as it is, counting each time the event loop resumes it."""
    import types

    @types.coroutine
    def wrapper():
        value = None
        while True:
            resumes[0] += 1
            try:
                yielded = coro.send(value)
            except StopIteration as stop:
                return stop.value
            value = yield yielded

    return wrapper()


def test_the_generator_wakes_once_per_arrival_instead_of_spinning_to_it():
    """Between arrivals the generator waits for the next one's time: the loop resumes it about
    once per request. It once slept to 2 ms before each arrival and then yield-spun to it (a
    resume every few microseconds), a fifth to a half of a core at 200-1,000 requests/s, taken
    from a CPU server on the same machine."""
    import asyncio
    from types import SimpleNamespace

    from gpulens.serve.loadgen import _Driver

    config = LoadConfig(url="http://x", tenants=(TenantSpec("m", 400.0),))
    driver = _Driver(config, None, SimpleNamespace(ClientTimeout=lambda total: None), [b""])
    sent_late_s: list[float] = []

    def record_start(i: int) -> None:
        sent_late_s.append(time.perf_counter() - driver.t0 - driver.sched[i])
        driver.started = i + 1

    driver._start = record_start
    n = 40  # 2.5 ms apart: 0.1 s
    times, owners = np.arange(1, n + 1) * 2.5e-3, np.zeros(n, dtype=np.int32)
    resumes = [0]
    asyncio.run(_counting(driver.open_loop(times, owners), resumes))
    assert driver.started == n
    assert min(sent_late_s) >= 0.0  # never sent before its time
    assert resumes[0] <= 2 * n + 2, f"{resumes[0]} resumes for {n} requests: it spins"


def test_the_due_timer_returns_at_its_time_or_later_and_lets_go_of_its_file():
    import asyncio
    import os
    import sys

    from gpulens.serve.wakeup import due_timer

    async def main():
        timer = due_timer()
        if sys.platform.startswith("linux"):
            assert timer.precise  # a timerfd: asyncio's own timers round up to 1 ms
        resumes = [0]
        target = time.perf_counter() + 0.003
        await _counting(timer.wait_until(target), resumes)
        woke = time.perf_counter()
        past = [0]
        await _counting(timer.wait_until(woke - 1.0), past)  # due already: no wait at all
        fd = getattr(timer, "fd", None)
        timer.close()
        timer.close()  # twice is harmless
        if fd is not None:
            with pytest.raises(OSError):
                os.fstat(fd)  # closed
        return target, woke, resumes[0], past[0]

    target, woke, resumes, past = asyncio.run(main())
    assert woke >= target and resumes <= 2 and past == 1


# ------------------------------------------------------------------------------ report math
def records(latency_ms, status, warmup_n=0, duration_s=10.0, tenant=None) -> lr.LoadRecords:
    n = len(latency_ms)
    sched = np.linspace(1.0, 1.0 + duration_s, n, endpoint=False)
    sched[:warmup_n] = np.linspace(0.0, 0.9, warmup_n)
    sent = sched + 0.0001
    return lr.LoadRecords(
        tenant=np.zeros(n, dtype=np.int32) if tenant is None else np.asarray(tenant),
        scheduled_s=sched, sent_s=sent, done_s=sched + np.asarray(latency_ms) / 1000.0,
        status=np.asarray(status, dtype=np.int32), warmup_s=1.0, duration_s=duration_s,
    )  # fmt: skip


def test_percentiles_attainment_goodput_and_errors_on_hand_made_records():
    # 100 measured requests: latencies 1..96 ms OK, then a 500, a 503, a timeout, a refused
    # connection; 5 warm-up requests of 1000 ms that must not count anywhere
    lat = [1000.0] * 5 + [float(k) for k in range(1, 97)] + [5.0] * 4
    status = [200] * 101 + [500, 503, lr.ERR_TIMEOUT, lr.ERR_CONNECTION]
    rec = records(lat, status, warmup_n=5)
    t = lr.tenant_report(rec, 0, "m", rate_rps=10.0, slo_ms=50.0)
    assert t["requests"] == 100
    assert t["achieved_rate_rps"] == pytest.approx(9.6)  # 96 OK in 10 s
    assert t["latency_ms"]["p50"] == pytest.approx(np.percentile(np.arange(1, 97), 50))
    assert t["latency_ms"]["p99"] == pytest.approx(np.percentile(np.arange(1, 97), 99))
    assert t["latency_ms"]["p999"] <= 96.0  # the warm-up's 1000 ms is excluded
    assert t["slo_attainment"] == pytest.approx(0.50)  # 50 within 50 ms; errors are misses
    assert t["goodput_rps"] == pytest.approx(5.0)
    assert t["errors"] == {
        "count": 4,
        "by_kind": {"connection": 1, "http_500": 1, "http_503": 1, "timeout": 1},
    }


def test_no_slo_means_every_success_counts_and_cost_follows_goodput():
    rec = records([10.0] * 50, [200] * 50, duration_s=5.0)
    t = lr.tenant_report(rec, 0, "m", rate_rps=10.0, slo_ms=None)
    assert t["slo_attainment"] is None and t["goodput_rps"] == pytest.approx(10.0)
    assert lr.cost_per_1k_requests(3.6, 10.0) == pytest.approx(0.1)  # 3.6 $/h, 36,000 req/h
    assert lr.cost_per_1k_requests(None, 10.0) is None
    assert lr.cost_per_1k_requests(3.6, 0.0) is None


def test_generator_lateness_is_reported_and_flagged():
    rec = records([5.0] * 200, [200] * 200)
    rec.sent_s = rec.scheduled_s + np.where(np.arange(200) % 10 == 0, 0.004, 0.0001)
    specs = (TenantSpec("m", 20.0, slo_ms=10.0),)
    doc = lr.build_document("http://x", specs, rec, None, 2.0, server_reason="none")
    assert doc["loadgen_lateness_ms_p99"] == pytest.approx(4.0, abs=0.01)
    assert doc["generator_limited"] is True
    assert "lateness p99" in doc["generator_notes"][0]
    rec.sent_s = rec.scheduled_s + 0.0001
    doc = lr.build_document("http://x", specs, rec, None, 2.0)
    assert not doc["generator_limited"] and doc["cost_per_1k_requests_usd"] is not None
    # a server answering 500 to half, the generator on time: the shortfall is said, but the
    # generator was not the limit (it once read generator_limited: true)
    rec.status[::2] = 500
    doc = lr.build_document("http://x", specs, rec, None, 2.0)
    assert "achieved" in doc["generator_notes"][0] and doc["generator_limited"] is False


def test_a_window_without_requests_says_so():
    rec = records([5.0] * 20, [200] * 20)
    specs = (TenantSpec("m", 20.0, slo_ms=10.0), TenantSpec("idle", 0.05))
    doc = lr.build_document("http://x", specs, rec, None)  # every request is m's
    idle = doc["tenants"][1]
    assert idle["requests"] == 0 and idle["latency_ms"]["p50"] is None
    assert any(n.startswith("idle: no request was due") for n in doc["generator_notes"])
    assert not any(n.startswith("m:") for n in doc["generator_notes"])
    assert doc["generator_limited"] is False


def test_a_closed_loop_intends_no_rate_single_stream_included():
    rec = records([5.0] * 20, [200] * 20)
    specs = (TenantSpec("m", 20.0, slo_ms=10.0),)  # a rate given, and not used
    for kw in ({"concurrency": 2}, {"scenario": "single-stream"}):
        doc = lr.build_document("http://x", specs, rec, None, **kw)
        assert doc["tenants"][0]["intended_rate_rps"] is None, kw  # single-stream said 20.0
    assert lr.build_document("http://x", specs, rec, None)["tenants"][0]["intended_rate_rps"] == 20


def test_the_offline_scenario_sends_everything_at_once_so_lateness_is_no_warning():
    rec = records([5.0] * 200, [200] * 200)
    rec.scheduled_s[:] = rec.scheduled_s[0]  # every request due at once, sent over 20 ms
    rec.sent_s = rec.scheduled_s + np.linspace(0.0, 0.020, 200)
    specs = (TenantSpec("m", 20.0, slo_ms=10.0),)
    doc = lr.build_document("http://x", specs, rec, None, scenario="offline")
    assert doc["loadgen_lateness_ms_p99"] > 10.0  # still measured and in the document
    assert not doc["generator_limited"] and doc["generator_notes"] == []
    doc = lr.build_document("http://x", specs, rec, None, scenario="server")
    assert "lateness p99" in doc["generator_notes"][0]


# ------------------------------------------------------------------------------ /metrics
def test_server_split_from_two_triton_scrapes():
    before = (FIXTURES / "before.txt").read_text()
    after = (FIXTURES / "after.txt").read_text()
    samples = lr.parse_prometheus(before)
    assert ("nv_gpu_memory_used_bytes", {"gpu_uuid": samples[-1][1]["gpu_uuid"]}, 3.2e9) in [
        (n, lab, v) for n, lab, v in samples
    ]
    split = lr.server_split(before, after, ["resnet50", "bert", "absent"])["models"]
    r = split["resnet50"]
    assert r["requests"] == 400
    assert r["mean_queue_ms"] == pytest.approx(2.5)  # 1,000,000 us over 400 requests
    assert r["mean_compute_ms"] == pytest.approx(5.0)
    assert r["mean_batch_size"] == pytest.approx(8.0)  # 400 inferences in 50 executions
    assert r["mean_compute_input_ms"] == 0.0
    b = split["bert"]  # two versions summed
    assert (b["requests"], b["mean_queue_ms"], b["mean_batch_size"]) == (100, 3.0, 4.0)
    assert "reason" in split["absent"]


# ------------------------------------------------------------------------------ request body
def test_small_inputs_go_as_json_and_large_ones_as_binary():
    meta = {"name": "m", "inputs": [
        {"name": "ids", "datatype": "INT64", "shape": [-1, 8]},
        {"name": "img", "datatype": "FP16", "shape": [-1, 3, 32, 32]},
    ]}  # fmt: skip
    req = kserve_request(meta, batch=2, rng=np.random.default_rng(0))
    assert req.binary and req.path == "/v2/models/m/infer"
    hlen = int(req.headers[BINARY_HEADER])
    head = json.loads(req.body[:hlen])
    ids, img = head["inputs"]
    assert ids["shape"] == [2, 8] and len(ids["data"]) == 16 and "parameters" not in ids
    assert img["shape"] == [2, 3, 32, 32] and "data" not in img
    assert img["parameters"]["binary_data_size"] == 2 * 3 * 32 * 32 * 2
    assert len(req.body) == hlen + img["parameters"]["binary_data_size"]
    small = kserve_request({"name": "m", "inputs": meta["inputs"][:1]}, 1, np.random.default_rng(0))
    assert not small.binary and json.loads(small.body)["inputs"][0]["shape"] == [1, 8]
    assert concrete_shape([-1, -1, 4], 3) == [3, 1, 4]


def test_find_max_search_on_a_known_limit():
    limit = 137.0
    seen = []

    def trial(rate):
        seen.append(rate)
        att = 1.0 if rate <= limit else 0.5
        return {"tenants": [{"model": "m", "slo_attainment": att, "achieved_rate_rps": rate,
                             "latency_ms": {"p99": 1.0}}]}  # fmt: skip

    result, doc = find_max(trial, "m", 10.0, 50.0, max_trials=20, tolerance=0.02)
    assert result["converged"] and limit * 0.98 <= result["max_rate_rps"] <= limit
    assert seen[:5] == [10, 20, 40, 80, 160]  # exponential growth, then bisection
    assert doc["tenants"][0]["achieved_rate_rps"] == result["max_rate_rps"]
    with pytest.raises(UsageError, match="needs an SLO"):
        find_max(trial, "m", 10.0, None)


def test_analysis_imports_without_torch_and_the_generator_without_aiohttp():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['aiohttp'] = None\n"
        "import gpulens.serve.load_report, gpulens.serve.load_config, gpulens.serve.load_search\n"
        "import gpulens.serve.loadgen, gpulens.serve.openai_load, gpulens.serve.http_client\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
