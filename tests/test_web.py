"""`gpulens ui`: the dashboard's pages over a store of real H100 records, its safety rules, and
(where Debian's chromium is installed) the pages drawn in a headless browser."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("plotly", reason="the dashboard needs the [ui] extra (in [dev])")

from gpulens.errors import UsageError  # noqa: E402
from gpulens.record.schema import STEPS_SCHEMA  # noqa: E402
from gpulens.record.writer import RunWriter  # noqa: E402
from gpulens.web.server import make_server  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
JPEG_ID = "20261122-035651-9e46cf"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def store(tmp_path, monkeypatch):
    home = tmp_path / "home"
    runs = home / "runs"
    runs.mkdir(parents=True)
    shutil.copytree(FIXTURES / "record_h100_resnet50_jpeg", runs / JPEG_ID)
    for run in (FIXTURES / "stalls_h100_resnet50_s8").iterdir():
        shutil.copytree(run, runs / run.name)
    monkeypatch.setenv("GPULENS_HOME", str(home))
    return home


@pytest.fixture
def serve(store):
    servers = []

    def start(**kw):
        server, url = make_server(port=0, **kw)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return url

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def get(url: str, method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_runs_table_lists_and_filters_the_store(serve):
    url = serve()
    status, page = get(url)
    assert status == 200 and page.count("<tr class='run'>") == 4
    status, page = get(url + "?kind=stalls")
    assert page.count("<tr class='run'>") == 3 and JPEG_ID not in page
    status, page = get(url + "?q=paired")
    assert page.count("<tr class='run'>") == 1


def test_run_and_compare_pages_carry_the_reports_figures(serve):
    url = serve()
    status, page = get(url + f"run/{JPEG_ID}")
    assert status == 200
    assert len(re.findall(r'id="figure-\d+"', page)) == 2  # timeline, step times
    assert "src='/static/plotly.js'" in page and "http-equiv='refresh'" not in page
    stalls = sorted(p.name for p in (FIXTURES / "stalls_h100_resnet50_s8").iterdir())
    status, page = get(url + "compare?runs=" + ",".join(stalls))
    assert status == 200 and "stall breakdown" in page and "comparison" in page
    status, js = get(url + "static/plotly.js")
    assert status == 200 and "Plotly" in js[:5000]


def test_a_running_run_is_shown_live(serve, store):
    w = RunWriter(store / "runs", kind="train", name="live")
    steps = w.series("steps", STEPS_SCHEMA, flush_interval_s=0.0)
    try:
        for i in range(5):
            steps.append({"step": i, "time_unix_s": time.time() + i, "warmup": False,
                          "samples": 8, "data_wait_s": 0.01, "h2d_s": 0.001,
                          "compute_s": 0.02, "step_time_s": 0.031})  # fmt: skip
        steps.flush()
        url = serve()
        _, first = get(url + f"run/{w.run_id}")
        assert "http-equiv='refresh'" in first and "reloads every" in first
        for i in range(5, 40):
            steps.append({"step": i, "time_unix_s": time.time() + i, "warmup": False,
                          "samples": 8, "data_wait_s": 0.01, "h2d_s": 0.001,
                          "compute_s": 0.02, "step_time_s": 0.031})  # fmt: skip
        steps.flush()
        _, second = get(url + f"run/{w.run_id}")
        assert len(second) > len(first)  # the record grew, the page with it
    finally:
        steps.close()
        w.finish()


@pytest.mark.parametrize(
    "path", ["run/../../etc/passwd", "run/%2e%2e%2fetc%2fpasswd", "run/" + "x" * 300, "nope"]
)
def test_nothing_outside_the_store_is_served(serve, path):
    status, page = get(serve() + path)
    assert status == 404 and "root:" not in page


def test_the_dashboard_is_read_only(serve):
    url = serve()
    for method in ("POST", "PUT", "DELETE"):
        assert get(url, method)[0] == 405


def test_beyond_loopback_a_token_is_required(serve):
    with pytest.raises(UsageError, match="--token"):
        make_server(host="0.0.0.0", port=0)
    url = serve(token="s3cret")
    base = url.split("?")[0]
    assert get(base)[0] == 403
    assert get(base + "?token=wrong")[0] == 403
    status, page = get(url)
    assert status == 200 and "token=s3cret" in page  # links carry it


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt install chromium)")
def test_pages_render_in_a_headless_browser(serve, tmp_path):
    url = serve()
    stalls = sorted(p.name for p in (FIXTURES / "stalls_h100_resnet50_s8").iterdir())
    pages = {"runs": url, "run": url + f"run/{JPEG_ID}",
             "compare": url + "compare?runs=" + ",".join(stalls)}  # fmt: skip
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--enable-logging=stderr", "--v=0", "--virtual-time-budget=15000"]  # fmt: skip
    for name, page_url in pages.items():
        profile = tmp_path / f"profile-{name}"
        dom = subprocess.run(
            [CHROMIUM, *flags, f"--user-data-dir={profile}", "--dump-dom", page_url],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        errors = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line and "rror" in line]
        assert not errors, (name, errors)
        if name != "runs":
            figures = len(re.findall(r'id="figure-\d+"', get(page_url)[1]))
            assert dom.stdout.count('class="plot-container plotly"') == figures >= 2
        else:
            assert dom.stdout.count('<tr class="run">') == 4
        shot = tmp_path / f"{name}.png"  # the test run's screenshots
        subprocess.run(
            [CHROMIUM, *flags, f"--user-data-dir={profile}", "--window-size=1200,1600",
             f"--screenshot={shot}", page_url],
            capture_output=True, timeout=120,
        )  # fmt: skip
        assert shot.stat().st_size > 10_000
