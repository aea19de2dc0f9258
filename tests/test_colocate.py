"""gpulens colocate on CPU: job syntax, result arithmetic, fit checks, planning, the CLI."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from gpulens.cli import main
from gpulens.colocate import (
    CONTEXT_BYTES,
    ColocateConfig,
    jain_index,
    memory_fit,
    normalized_throughputs,
    recommend,
    slowdown,
    summarize_result,
)
from gpulens.colocate.plan import (
    best_options,
    exhaustive_plan,
    greedy_plan,
    options_from_docs,
    plan,
)
from gpulens.errors import UsageError
from gpulens.workloads.jobspec import JobSpec, parse_job, percentile, unique_names

CONTRACT_TOP = {"gpu", "jobs", "results", "recommendation"}
CONTRACT_RESULT = {
    "mechanism", "setting", "fits", "jobs", "normalized_aggregate_throughput", "jain_fairness",
    "energy_per_sample_j",
}  # fmt: skip
CONTRACT_JOB = {
    "name", "throughput_alone", "throughput_together", "slowdown", "step_time_p99_s",
    "peak_mem_bytes",
}  # fmt: skip


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------------------- job syntax
def test_parse_jobs():
    j = parse_job("resnet18:batch=64,precision=bf16")
    assert (j.kind, j.workload, j.batch_size, j.precision) == ("train", "resnet18", 64, "bf16")
    assert j.key == "train:resnet18:batch=64,precision=bf16"
    assert parse_job("resnet50").batch_size == 128  # the workload's default
    i = parse_job("infer:resnet50:rate=100")
    assert (i.kind, i.batch_size, i.rate_per_s, i.name) == ("infer", 1, 100.0, "infer-resnet50")
    c = parse_job("cmd:python train.py --epochs 1")
    assert c.kind == "cmd" and c.command == ("python", "train.py", "--epochs", "1")
    assert JobSpec.from_dict(j.to_dict()) == j
    names = [x.name for x in unique_names([parse_job("tiny_cnn")] * 2 + [parse_job("resnet18")])]
    assert names == ["tiny_cnn#1", "tiny_cnn#2", "resnet18"]


def test_job_options_may_be_split_by_colons_as_load_writes_tenants():
    commas = parse_job("infer:resnet50:batch=2,rate=100,slo_ms=50,arrivals=poisson,name=i")
    assert parse_job("infer:resnet50:batch=2:rate=100:slo_ms=50:arrival=poisson:name=i") == commas
    assert parse_job("infer:resnet50:batch=2,rate=100:slo_ms=50,arrivals=poisson:name=i") == commas
    assert parse_job("resnet18:batch=64:precision=bf16") == parse_job(
        "resnet18:batch=64,precision=bf16"
    )
    with pytest.raises(UsageError) as bad:
        parse_job("infer:resnet50:rate=100:slo=50")
    assert "WORKLOAD[:key=value,key=value...]" in str(bad.value)  # the accepted form
    assert "':' between options works too" in str(bad.value) and "slo_ms" in str(bad.value)


@pytest.mark.parametrize(
    "text", ["nosuchmodel", "resnet18:batch=0", "resnet18:bogus=1", "resnet18:precision=fp8",
             "train:resnet18:rate=5", "resnet18:batch=x", "cmd:", "a:b:c:d"],
)  # fmt: skip
def test_bad_jobs_are_usage_errors(text):
    with pytest.raises(UsageError):
        parse_job(text)


def test_config_validation():
    two = [parse_job("tiny_cnn"), parse_job("tiny_cnn")]
    with pytest.raises(UsageError, match="two jobs"):
        ColocateConfig(jobs=two[:1])
    with pytest.raises(UsageError, match="mechanism"):
        ColocateConfig(jobs=two, mechanisms=("gang",))
    with pytest.raises(UsageError, match="thread"):
        ColocateConfig(jobs=two, mps_thread_pcts=(0,))
    with pytest.raises(UsageError, match="max-slowdown"):
        ColocateConfig(jobs=two, max_slowdown=0.5)
    with pytest.raises(UsageError, match="8G"):
        ColocateConfig(jobs=two, mps_mem_limit="lots")
    assert [j.name for j in ColocateConfig(jobs=two).jobs] == ["tiny_cnn#1", "tiny_cnn#2"]


# ------------------------------------------------------------------------------- arithmetic
def test_result_arithmetic():
    assert slowdown(100.0, 50.0) == 2.0
    assert slowdown(None, 50.0) is None and slowdown(100.0, None) is None
    assert normalized_throughputs([(100.0, 80.0), (50.0, 40.0)]) == [0.8, 0.8]
    assert normalized_throughputs([(100.0, None)]) is None
    assert jain_index([0.8, 0.8]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0]) == pytest.approx(0.5)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_index([0.9, 0.3]) == pytest.approx(1.2**2 / (2 * (0.81 + 0.09)))
    r = summarize_result({"jobs": [
        {"throughput_alone": 100.0, "throughput_together": 80.0},
        {"throughput_alone": 200.0, "throughput_together": 100.0},
    ]})  # fmt: skip
    assert r["normalized_aggregate_throughput"] == pytest.approx(1.3)
    assert r["jain_fairness"] == pytest.approx(1.3**2 / (2 * (0.64 + 0.25)))
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([], 99) is None


def test_memory_fit():
    gib = 2**30
    fits, needed, why = memory_fit([10 * gib, 20 * gib], 80 * gib, processes=2)
    assert fits is True and needed == 30 * gib + 2 * CONTEXT_BYTES and why is None
    fits, needed, why = memory_fit([40 * gib, 39 * gib], 80 * gib, processes=2)
    assert fits is False and "does not fit" in why and "80.0 GiB" in why
    # one process (streams) saves a context: fits where two processes would not
    peaks = [39 * gib, 38 * gib]
    assert memory_fit(peaks, 80 * gib, processes=1)[0] is True
    assert memory_fit(peaks, 80 * gib, processes=3)[0] is False
    assert memory_fit([None, gib], 80 * gib, processes=2)[0] is None  # cannot tell
    assert memory_fit([gib], None, processes=1)[0] is None


def _result(mech, setting, jobs, status="ok"):
    return summarize_result({
        "mechanism": mech, "setting": setting, "status": status, "fits": True,
        "jobs": [{"name": n, "key": k, "kind": kind, "throughput_alone": a,
                  "throughput_together": t, "slowdown": slowdown(a, t),
                  "step_time_p99_s": p99, "step_time_p99_alone_s": p99a}
                 for n, k, kind, a, t, p99, p99a in jobs],
    })  # fmt: skip


def test_recommendation_picks_best_within_cap():
    ts = _result(
        "time-slice",
        "default",
        [("a", "A", "train", 100, 70, None, None), ("b", "B", "train", 100, 70, None, None)],
    )
    mps = _result(
        "mps",
        "thread_pct=50",
        [("a", "A", "train", 100, 90, None, None), ("b", "B", "train", 100, 65, None, None)],
    )
    failed = _result(
        "streams",
        "default",
        [("a", "A", "train", 100, None, None, None), ("b", "B", "train", 100, None, None, None)],
        "failed",
    )
    doc = {"jobs": [{"name": "a"}, {"name": "b"}], "results": [ts, mps, failed]}
    text = recommend(doc)
    assert text.startswith("run a and b together under MPS (thread_pct=50): 1.55x")
    assert "b slows 35%" in text
    # a cap of 1.5x excludes MPS (b at 1.54x) and leaves time-slicing
    assert "time-slicing: 1.40x" in recommend(doc, max_slowdown=1.5)
    assert "separate GPUs" in recommend(doc, max_slowdown=1.05)


@pytest.mark.parametrize(
    "together, says",
    [(99.8, "slows 0%"), (100.0, "slows 0%"), (100.3, "slows 0%"), (105.0, "speeds up 5%"),
     (80.0, "slows 20%")],
)  # fmt: skip
def test_a_slowdown_that_rounds_to_zero_or_is_a_speed_up_reads_as_such(together, says):
    jobs = [("a", "A", "train", 100, together, None, None),
            ("b", "B", "train", 50, together / 2, None, None)]  # fmt: skip
    r = _result("time-slice", "default", jobs)
    text = recommend({"jobs": [{"name": "a"}, {"name": "b"}], "results": [r]})
    assert f"a {says}" in text and "-0%" not in text and "slows -" not in text


def test_recommendation_mentions_inference_latency():
    r = _result(
        "streams",
        "inference high priority",
        [("t", "T", "train", 100, 80, 0.02, 0.02), ("i", "I", "infer", 50, 50, 0.012, 0.004)],
    )
    text = recommend({"jobs": [{"name": "t"}, {"name": "i"}], "results": [r]})
    assert "1.80x" in text and "i p99 latency 4.0 ms alone, 12.0 ms together" in text


# ------------------------------------------------------------------------------- planning
def _doc(results, run_id="r1"):
    return {"gpu": None, "jobs": [], "results": results, "recommendation": "", "run_id": run_id}


def _pair(mech, setting, ka, kb, na, nb):
    """A measured pair whose jobs reach ``na`` and ``nb`` of their alone throughput."""
    return _result(
        mech,
        setting,
        [
            ("a", ka, "train", 100.0, 100.0 * na, None, None),
            ("b", kb, "train", 100.0, 100.0 * nb, None, None),
        ],
    )


def _jobs(*keys):
    """JobSpecs whose keys are the given letters (cmd jobs: cheap, no workload lookup)."""
    return unique_names([JobSpec("cmd", command=(k,), name=k) for k in keys])


def _k(letter):
    return f"cmd:{letter}"


def test_plan_greedy_vs_exhaustive():
    A, C = _k("A"), _k("C")
    docs = [_doc([
        _pair("mps", "thread_pct=50", A, A, 0.8, 0.8),  # AA: 1.6
        _pair("time-slice", "default", C, C, 0.55, 0.55),  # CC: 1.1
        _pair("mps", "thread_pct=100", A, C, 0.75, 0.75),  # AC: 1.5
    ])]  # fmt: skip
    out = plan(_jobs("A", "A", "C", "C"), docs)
    # greedy takes AA (1.6) first, leaving CC (1.1): 2.7 on 2 GPUs; best is AC + AC: 3.0
    assert out["plan"]["gpus"] == 2
    assert out["plan"]["normalized_throughput"] == pytest.approx(2.7)
    assert out["exhaustive"]["normalized_throughput"] == pytest.approx(3.0)
    assert out["quality"] == pytest.approx(2.7 / 3.0)
    assert all(g["mechanism"] == "mps" for g in out["exhaustive"]["groups"])
    assert sorted(n for g in out["exhaustive"]["groups"] for n in g["jobs"]) == [
        "A#1", "A#2", "C#1", "C#2"]  # fmt: skip
    assert out["missing_pairs"] == []
    assert "% of the best found by exhaustive search" in out["recommendation"]


def test_plan_respects_slowdown_cap_and_reports_missing_pairs():
    A, B = _k("A"), _k("B")
    docs = [_doc([
        _pair("mps", "thread_pct=50", A, B, 0.95, 0.6),  # 1.55, B slows 1.67x
        _pair("time-slice", "default", A, B, 0.6, 0.6),  # 1.2, both 1.67x
        _pair("streams", "default", A, B, 0.7, 0.7),  # 1.4, both 1.43x
    ])]  # fmt: skip
    free = plan(_jobs("A", "B"), docs)
    assert free["plan"]["groups"][0]["mechanism"] == "mps"
    capped = plan(_jobs("A", "B"), docs, max_slowdown=1.5)
    assert capped["plan"]["groups"][0]["mechanism"] == "streams"
    alone = plan(_jobs("A", "B"), docs, max_slowdown=1.1)
    assert alone["plan"]["gpus"] == 2 and alone["quality"] == pytest.approx(1.0)
    out = plan(_jobs("A", "B", "Z"), docs)
    assert [_k("A"), _k("Z")] in out["missing_pairs"] and "never measured" in out["recommendation"]


def test_later_measurement_replaces_earlier():
    A = _k("A")
    docs = [_doc([_pair("mps", "x", A, A, 0.9, 0.9)], "old"),
            _doc([_pair("mps", "x", A, A, 0.6, 0.6)], "new")]  # fmt: skip
    (opt,) = options_from_docs(docs)
    assert opt.aggregate == pytest.approx(1.2) and opt.source == "new"


def _brute_force(keys, best):
    """Every set partition of the job positions, the straightforward way."""

    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for sub in partitions(rest):
            for i in range(len(sub)):
                yield sub[:i] + [[first, *sub[i]]] + sub[i + 1 :]
            yield [[first], *sub]

    top = 0.0
    for part in partitions(list(range(len(keys)))):
        total = 0.0
        for block in part:
            ks = tuple(sorted(keys[i] for i in block))
            if len(ks) == 1:
                total += 1.0
            elif ks in best:
                total += best[ks].aggregate
            else:
                break
        else:
            top = max(top, total / len(part))
    return top


def test_exhaustive_matches_brute_force_and_beats_greedy():
    rng = random.Random(7)
    letters = [_k(x) for x in "ABC"]
    for _ in range(30):
        results = []
        for a, b in itertools.combinations_with_replacement(letters, 2):
            if rng.random() < 0.8:
                results.append(_pair("mps", "p", a, b, rng.uniform(0.3, 1.0), rng.uniform(0.3, 1)))
        if rng.random() < 0.5:
            results.append(_result("mps", "p", [(f"x{i}", letters[0], "train", 1.0,
                                                 rng.uniform(0.3, 0.7), None, None)
                                                for i in range(3)]))  # fmt: skip
        best = best_options(options_from_docs([_doc(results)]), None)
        keys = [rng.choice(letters) for _ in range(rng.randint(2, 6))]

        def per_gpu(blocks):
            vals = [1.0 if isinstance(b, tuple) else b.aggregate for b in blocks]
            return sum(vals) / len(vals)

        ex = per_gpu(exhaustive_plan(keys, best))
        assert ex == pytest.approx(_brute_force(keys, best))
        assert per_gpu(greedy_plan(keys, best)) <= ex + 1e-9


# ------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize(
    "args, needle",
    [
        (["colocate", "tiny_cnn"], "two jobs"),
        (["colocate", "tiny_cnn", "tiny_cnn", "--mechanisms", "gang"], "unknown mechanism"),
        (["colocate", "tiny_cnn", "nosuch"], "unknown workload"),
        (["colocate", "tiny_cnn", "tiny_cnn", "--mps-thread-pct", "a,b"], "comma-separated"),
        (["colocate", "tiny_cnn", "tiny_cnn", "--mps-thread-pct", "150"], "(0, 100]"),
        (["colocate", "--plan", "tiny_cnn", "tiny_cnn"], "no collocation results"),
    ],
)
def test_cli_errors_are_one_line(capsys, args, needle):
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and out == ""
    assert needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "jobs, mechanisms, needle",
    [(["tiny_cnn", "tiny_cnn"], "streams", "streams: CUDA streams need a GPU"),
     (["cmd:true", "cmd:true"], "streams,mps,mig", "mig: MIG needs an NVIDIA GPU")],
)  # fmt: skip
def test_mechanisms_that_cannot_run_here_are_refused_before_any_job_runs(
    capsys, monkeypatch, gpulens_home, jobs, mechanisms, needle
):
    from gpulens.colocate import experiment

    def no_run(*_a, **_k):
        raise AssertionError("a job ran before the usage error")

    monkeypatch.setattr(experiment, "run_group", no_run)
    code, out, err = run_cli(capsys, "colocate", *jobs, "--mechanisms", mechanisms,
                             "--device", "cpu")  # fmt: skip
    assert code == 2 and out == ""
    (line,) = [x for x in err.splitlines() if x.startswith("error")]
    assert needle in line and "use --mechanisms time-slice, or a GPU (--device cuda:N)" in line
    assert "alone" not in err and "internal error" not in err
    # refused, nothing ran: no failed colocate record left in the store
    assert not list((gpulens_home / "runs").glob("*"))
    assert run_cli(capsys, "runs", "list", "--json")[1].count('"run_id"') == 0


@pytest.mark.slow
def test_cli_time_slice_end_to_end_on_cpu_and_plan_from_store(capsys, gpulens_home):
    code, out, err = run_cli(
        capsys, "colocate", "tiny_cnn:batch=8", "tiny_cnn:batch=8", "--device", "cpu",
        "--mechanisms", "time-slice,streams,mps,mig", "--duration", "1.5", "--warmup", "0.3",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    assert doc.keys() >= CONTRACT_TOP and doc["gpu"] is None
    by_mech = {r["mechanism"]: r for r in doc["results"]}
    assert set(by_mech) == {"time-slice", "streams", "mps", "mig"}
    for r in doc["results"]:
        assert r.keys() >= CONTRACT_RESULT
        for j in r["jobs"]:
            assert j.keys() >= CONTRACT_JOB
    ts = by_mech["time-slice"]
    assert ts["status"] == "ok" and ts["fits"] is True
    assert all(j["throughput_together"] > 0 and j["throughput_alone"] > 0 for j in ts["jobs"])
    ratios = [j["throughput_together"] / j["throughput_alone"] for j in ts["jobs"]]
    assert ts["normalized_aggregate_throughput"] == pytest.approx(sum(ratios))
    for j in ts["jobs"]:  # every throughput carries its 95% CI; the ratio's adds both
        a, t = j["throughput_alone_ci95_pct"], j["throughput_together_ci95_pct"]
        assert a > 0 and t > 0
        assert j["slowdown_ci95_pct"] == pytest.approx((a * a + t * t) ** 0.5)
    assert ts["energy_per_sample_j"] is None  # no GPU: not measured, never 0
    assert by_mech["mps"]["status"] == "unavailable" and "GPU" in by_mech["mps"]["error"]
    assert by_mech["streams"]["status"] == "unavailable"
    assert doc["recommendation"]
    # the run is stored and --plan finds it
    code, out, err = run_cli(capsys, "colocate", "--plan", "tiny_cnn:batch=8",
                             "tiny_cnn:batch=8", "--json")  # fmt: skip
    assert code == 0, err
    p = json.loads(out)
    assert p["measured_groups"] == 1 and p["quality"] == pytest.approx(1.0)


# ------------------------------------------------------------------------- cmd: jobs
def test_a_cmd_job_that_cannot_start_is_a_usage_error_before_anything_runs(capsys, gpulens_home):
    with pytest.raises(UsageError, match="nonexistent_cmd_xyz.*PATH"):
        ColocateConfig(jobs=[parse_job("cmd:nonexistent_cmd_xyz"), parse_job("cmd:true")])
    with pytest.raises(UsageError, match="does not exist"):
        ColocateConfig(jobs=[parse_job("cmd:./no/such/script.sh"), parse_job("cmd:true")])
    code, out, err = run_cli(
        capsys, "colocate", "cmd:nonexistent_cmd_xyz", "cmd:true", "--device", "cpu"
    )
    assert code == 2
    assert "nonexistent_cmd_xyz" in err and "internal error" not in err
    assert not (gpulens_home / "runs").exists() or not any((gpulens_home / "runs").iterdir())


def test_a_failing_cmd_job_fails_its_runs_and_the_experiment(tmp_path):
    import sys

    from gpulens.colocate import run_colocate
    from gpulens.record.reader import read_record

    bad = (
        f"cmd:{sys.executable} -c \"import sys; sys.stderr.write('boom: no data\\n'); sys.exit(3)\""
    )
    config = ColocateConfig(
        jobs=[parse_job(bad), parse_job("cmd:true")],
        mechanisms=("time-slice",),
        device="cpu",
        duration_s=0.5,
        warmup_s=0,
    )
    doc = run_colocate(config, tmp_path / "runs")
    assert doc["status"] == "failed"
    assert "nothing could be measured" in doc["error"] and "code 3" in doc["error"]
    job = doc["jobs"][0]
    assert job["exit_code"] == 3 and "boom: no data" in job["stderr_tail"]
    assert "exited with code 3" in job["error"] and "boom: no data" in job["error"]
    (result,) = doc["results"]
    assert result["status"] == "failed" and "failed alone" in result["error"]
    stored = read_record(doc["record_dir"])
    assert stored.status == "failed" and stored.result().role == "colocate:experiment"


def test_a_cmd_job_s_wall_time_ends_when_it_does_not_when_it_is_reaped(tmp_path):
    """Together, the group reaps commands one after another (and only after the built-in
    jobs' window): a short command listed after a longer one was timed until the longer one
    ended (sleep 2 beside a 3 s window: 2.0 s alone, 5.8 s together, a false 2.9x slowdown)."""
    from gpulens.colocate import run_colocate

    config = ColocateConfig(
        jobs=[parse_job("cmd:sleep 1"), parse_job("cmd:true")],
        mechanisms=("time-slice",),
        device="cpu",
        duration_s=0.5,
        warmup_s=0,
    )
    doc = run_colocate(config, None)
    (result,) = doc["results"]
    assert result["status"] == "ok", result.get("error")
    long, short = result["jobs"]
    assert long["step_time_p50_s"] >= 1.0
    # `true` ends at once: its wall time is its own, well below the sleep it was reaped after
    assert short["step_time_p50_s"] < long["step_time_p50_s"] - 0.5
    assert short["throughput_together"] == pytest.approx(1 / short["step_time_p50_s"])


def test_colocate_record_exists_before_the_slow_start_up(tmp_path, monkeypatch):
    """Killed while importing torch or starting NVML: a record marked killed is left."""
    from gpulens.colocate import run_colocate
    from gpulens.probes import environment
    from gpulens.record.reader import list_records

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(environment, "capture_environment", interrupted)
    config = ColocateConfig(jobs=[parse_job("cmd:true"), parse_job("cmd:true")], device="cpu")
    with pytest.raises(KeyboardInterrupt):
        run_colocate(config, tmp_path / "runs")
    (rec,) = list_records(tmp_path / "runs")
    assert rec.status == "killed"
    assert rec.meta["requested_config"]["jobs"][0]["command"] == ["true"]


def test_builtin_jobs_on_the_cpu_with_poisson_requests(tmp_path):
    """A training job beside an inference job fed by Poisson arrivals: both measured alone and
    together; the inference job's times are latencies from each request's arrival."""
    from gpulens.colocate import run_colocate

    config = ColocateConfig(
        jobs=[
            parse_job("tiny_cnn:batch=4"),
            parse_job("infer:tiny_cnn:rate=40,arrivals=poisson,slo_ms=200"),
        ],
        mechanisms=("time-slice",),
        device="cpu",
        duration_s=1.0,
        warmup_s=0,
    )
    doc = run_colocate(config, tmp_path / "runs")
    assert doc["status"] == "finished", doc.get("error")
    infer = [j for j in doc["jobs"] if j["kind"] == "infer"][0]
    assert infer["key"].endswith("rate=40,arrivals=poisson")
    assert infer["slo_ms"] == 200
    (result,) = doc["results"]
    assert result["status"] == "ok"
    train, infer = result["jobs"]
    assert train["steps"] > 0 and train["throughput_together"] > 0
    # About 40 requests in the 1 s window (Poisson: 40 +- 3 sigma), each served alone and
    # together, with latencies from their arrivals.
    assert 20 <= infer["steps"] <= 60
    assert 0 < infer["step_time_p50_alone_s"] <= infer["step_time_p99_alone_s"]
    # SLO attainment alone and together: the share of the latencies within 200 ms
    for share in (infer["slo_attainment_alone"], infer["slo_attainment"]):
        assert 0.0 <= share <= 1.0
    lost = 100 * (infer["slo_attainment_alone"] - infer["slo_attainment"])
    assert infer["slo_attainment_lost_pp"] == pytest.approx(lost)
    assert "slo_ms" not in train  # training jobs have no SLO columns
    # each job's throughput in what it counts: training samples, inference requests (batch 1)
    assert [j["throughput_unit"] for j in doc["jobs"]] == ["samples/s", "requests/s"]
    assert (train["throughput_unit"], infer["throughput_unit"]) == ("samples/s", "requests/s")


def test_slo_attainment_counts_latencies_within_the_target():
    from gpulens.colocate.metrics import slo_attainment, slo_fields

    assert slo_attainment([0.010, 0.020, 0.050, 0.051], 50) == 0.75
    assert slo_attainment([], 50) is None and slo_attainment([0.01], None) is None
    assert slo_fields(None, 1.0, 0.5) == {}
    fields = slo_fields(50.0, 0.99, 0.90)
    assert fields["slo_attainment_lost_pp"] == pytest.approx(9.0)
    assert slo_fields(50.0, None, 0.9)["slo_attainment_lost_pp"] is None
    job = parse_job("infer:tiny_cnn:rate=10,slo_ms=25")
    assert job.slo_ms == 25.0 and JobSpec.from_dict(job.to_dict()) == job
    with pytest.raises(UsageError, match="slo_ms= is for infer"):
        parse_job("tiny_cnn:slo_ms=25")
    with pytest.raises(UsageError, match="slo_ms"):
        parse_job("infer:tiny_cnn:slo_ms=fast")


def test_each_job_s_throughput_is_labelled_with_what_it_counts():
    """A training job counts samples, an inference tenant requests (samples when a request
    holds a batch), a cmd: job whole runs: the tables once called all three samples/s."""
    import io

    from rich.console import Console

    from gpulens.colocate.metrics import throughput_units
    from gpulens.report.colocate import render_colocate

    units = {text: parse_job(text).throughput_unit for text in (
        "tiny_cnn:batch=8", "infer:tiny_cnn:batch=1,rate=20", "infer:tiny_cnn:batch=4",
        "serve:identity:rate=10", "cmd:python train.py")}  # fmt: skip
    assert units == {
        "tiny_cnn:batch=8": "samples/s",
        "infer:tiny_cnn:batch=1,rate=20": "requests/s",
        "infer:tiny_cnn:batch=4": "samples/s",
        "serve:identity:rate=10": "requests/s",
        "cmd:python train.py": "runs/s",
    }
    jobs = [("tiny_cnn", "train:tiny_cnn:batch=8", "train", 412.5, 300.0, 0.02, 0.019),
            ("infer-tiny_cnn", "infer:tiny_cnn:batch=1,rate=20", "infer", 20.0, 19.5, 0.01,
             0.009),
            ("python", "cmd:python train.py", "cmd", 0.25, 0.125, 4.0, 8.0)]  # fmt: skip
    doc = {
        "jobs": [{"name": n, "key": k, "kind": kind, "throughput_alone": a,
                  "batch_size": {"train": 8, "infer": 1}.get(kind),
                  "throughput_unit": parse_job(k).throughput_unit} for n, k, kind, a, *_ in jobs],
        "results": [_result("time-slice", "default", jobs),
                    _result("mps", "thread_pct=100 (training jobs)", jobs)],
        "recommendation": "time-slice", "duration_s": 3.0, "device": "cpu",
    }  # fmt: skip
    console = Console(file=io.StringIO(), width=80, record=True)
    render_colocate(console, doc)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    # alone: the figure, then its unit; a cmd: job's few runs/s with two significant digits
    for figure in ("412.5  samples/s", "20.0  requests/s", "0.25  runs/s"):
        assert figure in text, figure
    headers = [line for line in text.splitlines() if line.startswith(("job ", "mechanism /"))]
    assert len(headers) == 2 and "throughput  unit" in headers[0], headers
    # together: the unit beside the job's name, so the mechanism labels keep the first column
    # whole (a unit column folded "mps · thread_pct=25 (training jobs)" on an H200)
    lines = [" ".join(line.split()) for line in text.splitlines()]
    for row in ("tiny_cnn (samples/s) 300.0", "infer-tiny_cnn (requests/s) 19.5",
                "python (runs/s) 0.12"):  # fmt: skip
        assert any(line.startswith(row) for line in lines), (row, text)
    assert "mps · thread_pct=100 (training jobs)" in lines, text
    # a document stored before jobs carried the unit: from the job's kind and batch
    for j in doc["jobs"]:
        del j["throughput_unit"]
    assert throughput_units(doc) == {"tiny_cnn": "samples/s", "infer-tiny_cnn": "requests/s",
                                     "python": "runs/s"}  # fmt: skip


def _column(text: str, header: str, start: str, end: str) -> str:
    """The cells of one table column, read down the lines below ``header`` and joined."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(header))
    a, b = lines[at].index(start), lines[at].index(end)
    cells = []
    for line in lines[at + 2 :]:
        if line.startswith(("together", "recommendation")):  # the table has ended
            break
        cells.append(line[a:b].strip())
    return "".join(cells)


def test_long_job_names_fold_in_an_80_column_table_instead_of_being_cut():
    import io

    from rich.console import Console

    from gpulens.report.colocate import render_colocate

    long = "a_really_long_job_name_that_goes_on_and_on"
    key = "train:tiny_cnn:batch=16,precision=fp32"
    ts = _result("time-slice", "default", [("tiny_cnn", "train:tiny_cnn", "train", 100, 70,
                                            None, None), (long, key, "train", 100, 60, None,
                                                          None)])  # fmt: skip
    doc = {
        "jobs": [
            {"name": "tiny_cnn", "key": "train:tiny_cnn", "throughput_alone": 100.0},
            {"name": long, "key": key, "throughput_alone": 100.0},
        ],
        "results": [ts], "recommendation": "time-slice", "duration_s": 3.0, "device": "cpu",
    }  # fmt: skip
    console = Console(file=io.StringIO(), width=80, record=True)
    render_colocate(console, doc)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    assert _column(text, "job ", "job", "samples/s") == "tiny_cnn" + long
    assert key in text.split()  # the job's key whole, on a line of its own if need be
    # the together tables: one row per mechanism, then each mechanism's jobs, indented
    assert _column(text, "mechanism  ", "mechanism", "aggregate") == "time-slice · default"
    assert _column(text, "mechanism / job", "mechanism", "samples/s") == (
        "time-slice · default" + "tiny_cnn" + long
    )


def test_the_together_table_keeps_every_figure_whole_in_80_columns():
    """As a streams-and-MPS experiment on an H100 printed it: with eleven columns side by side
    the figures were cut ("6,102…") and the mechanisms folded into four-letter pieces."""
    import io

    from rich.console import Console

    from gpulens.report.colocate import render_colocate

    jobs = [("resnet18", "train:resnet18:batch=64,precision=fp32", "train", 6728.6, 2131.4,
             0.0305, 0.0246),
            ("infer-resnet50", "infer:resnet50:batch=1,precision=fp32,rate=100", "infer",
             100.0, 100.0, 0.0712, 0.0636)]  # fmt: skip
    results = []
    for setting in ("default", "inference high priority"):
        results.append(_result("streams", setting, jobs))
    results.append(_result("mps", "thread_pct=25 (training jobs)", jobs))
    for r, (energy, sm) in zip(results, ((0.083, 73.0), (0.085, 69.0), (0.136, 17.0)), strict=True):
        r.update(energy_per_sample_j=energy, sm_activity_pct=sm)
    doc = {
        "jobs": [{"name": n, "key": k, "throughput_alone": a, "energy_per_sample_alone_j": 0.081,
                  "peak_mem_bytes": 2.29 * 2**30} for n, k, _, a, *_ in jobs],
        "results": results, "recommendation": "mps", "duration_s": 15.0, "device": "cuda:0",
    }  # fmt: skip
    console = Console(file=io.StringIO(), width=80, record=True)
    render_colocate(console, doc)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for figure in ("2,131.4", "3.16x", "30.5", "71.2", "1.32x", "0.79", "0.136", " 17"):
        assert figure in text, figure
    # each mechanism's label and each job's name whole, on one line
    for label in ("streams · default", "streams · inference high priority",
                  "mps · thread_pct=25 (training jobs)", "  infer-resnet50 "):  # fmt: skip
        assert label in text, label


# --------------------------------------------------------------------------------- energy
# Alone: training 0.2 J/sample, inference 0.5 J/request, the command 60 J/run. Together (one
# window, 200 J): 600 samples, 200 requests and 1 run, which took 120 + 100 + 60 = 280 J alone.
ALONE = {"train": (1000, 100.0, 200.0), "infer": (200, 20.0, 100.0), "cmd": (1, 0.5, 60.0)}
TOGETHER = {"train": 600, "infer": 200, "cmd": 1}


def _energy_experiment(tmp_path, keys):
    """An experiment over ``keys`` whose process group reports ALONE/TOGETHER counts and the
    GPU energy of each window (as the NVML energy counter would), without running anything."""
    from gpulens.colocate.device import DeviceInfo
    from gpulens.colocate.experiment import ColocateExperiment
    from gpulens.launch.group import GroupOutcome

    def group(procs):
        jobs = [j for p in procs for j in p.jobs]
        out = {}
        for j in jobs:
            count, tput, _ = ALONE[j.kind]
            if len(jobs) > 1:
                count, tput = TOGETHER[j.kind], tput * 0.6
            out[j.name] = {"samples": count, "throughput_samples_per_s": tput}
        energy = ALONE[jobs[0].kind][2] if len(jobs) == 1 else 200.0
        return GroupOutcome(out, window={"energy_j": energy, "window_s": 10.0})

    config = ColocateConfig(jobs=unique_names([parse_job(k) for k in keys]),
                            mechanisms=("time-slice",), duration_s=10.0, warmup_s=0.0)  # fmt: skip
    exp = ColocateExperiment(config, tmp_path, device_info=DeviceInfo("cpu"))
    exp._group = group
    return exp.run()


def test_energy_is_per_what_each_job_counts_and_compared_against_the_jobs_alone(tmp_path):
    """A mechanism's energy per sample once added samples, requests and runs (200 J / 801);
    a cmd: job's J/run was labelled J/sample."""
    doc = _energy_experiment(tmp_path, ["tiny_cnn:batch=8", "infer:tiny_cnn:batch=1,rate=20",
                                        "cmd:sleep 2"])  # fmt: skip
    jobs = {j["kind"]: j for j in doc["jobs"]}
    assert {k: (j["energy_unit"], j["energy_per_unit_alone_j"]) for k, j in jobs.items()} == {
        "train": ("J/sample", 0.2),
        "infer": ("J/request", 0.5),
        "cmd": ("J/run", 60.0),
    }
    assert jobs["train"]["energy_per_sample_alone_j"] == 0.2
    assert jobs["cmd"]["energy_per_sample_alone_j"] is None  # a run is no sample
    (r,) = doc["results"]
    assert r["energy_per_sample_j"] is None and r["energy_per_unit_j"] is None
    assert r["energy_unit"] is None and "count different things" in r["energy_note"]
    assert r["energy_vs_alone_ratio"] == pytest.approx(200 / 280)
    assert "29% less GPU energy for the work than each job alone" in doc["recommendation"]


def test_jobs_that_count_one_thing_get_energy_per_that_thing(tmp_path):
    doc = _energy_experiment(tmp_path, ["cmd:sleep 1", "cmd:sleep 2"])
    (r,) = doc["results"]
    # 2 runs together in 200 J; alone 60 J each
    assert (r["energy_unit"], r["energy_per_unit_j"]) == ("J/run", 100.0)
    assert r["energy_per_sample_j"] is None and r["energy_vs_alone_ratio"] == pytest.approx(
        200 / 120
    )
    assert "67% more GPU energy" in doc["recommendation"]
    doc = _energy_experiment(tmp_path, ["tiny_cnn:batch=8", "tiny_cnn:batch=16"])
    (r,) = doc["results"]
    assert r["energy_unit"] == "J/sample"
    assert r["energy_per_sample_j"] == r["energy_per_unit_j"] == pytest.approx(200 / 1200)
    assert r["energy_note"] is None


def test_each_job_s_energy_is_shown_in_its_own_unit(tmp_path):
    import io

    from rich.console import Console

    from gpulens.report.colocate import render_colocate
    from gpulens.report.document import colocate_energy_facts

    doc = _energy_experiment(tmp_path, ["tiny_cnn:batch=8", "infer:tiny_cnn:batch=1,rate=20",
                                        "cmd:sleep 2"])  # fmt: skip
    console = Console(file=io.StringIO(), width=80, record=True)
    render_colocate(console, doc)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for cell in ("0.200 J/sample", "0.500 J/request", "60.000 J/run", "0.71x"):
        assert cell in text, cell
    assert "J/sample " not in text.replace("0.200 J/sample", "")  # no column headed J/sample
    facts = dict(colocate_energy_facts(doc))
    assert facts["GPU energy alone"] == (
        "tiny_cnn 0.200 J/sample; infer-tiny_cnn 0.500 J/request; sleep 60.000 J/run"
    )
    assert facts["GPU energy together"] == "time-slice: 0.71x the jobs alone"
