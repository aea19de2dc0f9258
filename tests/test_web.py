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
    status, page = get(url + "?role=stalls:cached&date=2026-11-24")
    assert page.count("<tr class='run'>") == 1
    status, page = get(url + "?workload=resnet50&date=2026-11-22")
    assert page.count("<tr class='run'>") == 1 and JPEG_ID in page
    for name in ("kind", "workload", "gpu_model", "date", "status", "role"):
        assert f"<select name='{name}'>" in page


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
    status, page = get(url + f"compare?runs={JPEG_ID},{JPEG_ID}")  # one run, not compared to itself
    assert status == 200 and "<h2>comparison</h2>" not in page and page.count("<h2>") == 1


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


CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser(tmp_path):
    """Headless Chromium driven through Debian's chromedriver (Selenium; nothing downloaded)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (in [dev])")
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (apt install chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1200,1600",
                 f"--user-data-dir={tmp_path / 'profile'}"):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _wait_for_rows(driver, n: int, url_part: str, timeout_s: float = 30.0) -> list:
    """The table rows once the page that ``url_part`` names has loaded (a click's navigation
    is not awaited by Selenium)."""
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout_s
    rows: list = []
    while time.monotonic() < deadline:
        try:
            if url_part in driver.current_url:
                rows = driver.find_elements(By.CSS_SELECTOR, "tr.run")
                if len(rows) == n:
                    return rows
        except Exception:  # the old page went away mid-look
            pass
        time.sleep(0.2)
    return rows


def _wait_for_figures(driver, n: int, timeout_s: float = 30.0) -> int:
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout_s
    found = 0
    while time.monotonic() < deadline:
        found = len(driver.find_elements(By.CSS_SELECTOR, "div.plot-container.plotly"))
        if found >= n:
            break
        time.sleep(0.2)
    return found


def test_a_user_filters_opens_a_run_and_compares_in_a_browser(serve, browser, tmp_path):
    """Clicks as a user would: filter by kind, open a run from the table, tick two runs and
    compare them; every page draws its figures with no console error. Screenshots are kept."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    url = serve()
    browser.get(url)
    assert len(browser.find_elements(By.CSS_SELECTOR, "tr.run")) == 4
    browser.save_screenshot(str(tmp_path / "runs.png"))

    Select(browser.find_element(By.NAME, "kind")).select_by_visible_text("stalls")
    browser.find_element(By.XPATH, "//button[text()='filter']").click()
    assert len(_wait_for_rows(browser, 3, "kind=stalls")) == 3

    browser.find_element(By.NAME, "q").send_keys("paired")
    browser.find_element(By.XPATH, "//button[text()='filter']").click()
    (row,) = _wait_for_rows(browser, 1, "q=paired")
    row.find_element(By.TAG_NAME, "a").click()
    deadline = time.monotonic() + 30
    while "/run/" not in browser.current_url and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "/run/" in browser.current_url
    assert _wait_for_figures(browser, 2) >= 2
    browser.save_screenshot(str(tmp_path / "run.png"))

    browser.back()
    browser.back()  # the stalls-only table again
    _wait_for_rows(browser, 3, "kind=stalls")
    boxes = browser.find_elements(By.CSS_SELECTOR, "input[name='runs']")
    assert len(boxes) == 3
    for box in boxes[:2]:
        box.click()
    browser.find_element(By.XPATH, "//button[starts-with(text(), 'compare')]").click()
    deadline = time.monotonic() + 30
    while "/compare" not in browser.current_url and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "/compare" in browser.current_url
    assert _wait_for_figures(browser, 2) >= 2
    assert "comparison" in browser.page_source
    browser.save_screenshot(str(tmp_path / "compare.png"))
    assert not _console_errors(browser)
    assert all((tmp_path / f"{p}.png").stat().st_size > 10_000 for p in ("runs", "run", "compare"))


def test_the_live_view_follows_a_running_run_in_a_browser(serve, store, browser):
    """A running run's page reloads by itself and shows the steps written meanwhile."""
    from selenium.webdriver.common.by import By

    w = RunWriter(store / "runs", kind="train", name="live")
    steps = w.series("steps", STEPS_SCHEMA, flush_interval_s=0.0)

    def write(first: int, last: int) -> None:
        for i in range(first, last):
            steps.append({"step": i, "time_unix_s": time.time() + i, "warmup": False,
                          "samples": 8, "data_wait_s": 0.01, "h2d_s": 0.001,
                          "compute_s": 0.02, "step_time_s": 0.031})  # fmt: skip
        steps.flush()

    try:
        write(0, 5)
        browser.get(serve() + f"run/{w.run_id}")
        first = browser.find_element(By.TAG_NAME, "body").get_attribute("innerHTML")
        write(5, 60)
        deadline = time.monotonic() + 20  # it reloads every 5 s
        grown = False
        while time.monotonic() < deadline and not grown:
            time.sleep(1.0)
            try:
                now = browser.find_element(By.TAG_NAME, "body").get_attribute("innerHTML")
            except Exception:  # mid-reload
                continue
            grown = len(now) > len(first) + 200
        assert grown, "the page did not reload with the new steps"
        assert not _console_errors(browser)
    finally:
        steps.close()
        w.finish()


def test_a_damaged_record_is_named_on_the_runs_page_and_on_its_own(serve, store):
    """A half-written run.json: the runs page lists the readable runs and names the damaged one
    with its fix (as `gpulens runs list` does); its own page says what is wrong, not 'no such
    run'."""
    bad = store / "runs" / "20261128-100000-aaaaaa"
    bad.mkdir()
    (bad / "run.json").write_text('{"run_id": "20261128-100000-aaaaaa", "sta')
    url = serve()
    status, page = get(url)
    assert status == 200 and page.count("<tr class='run'>") == 4
    assert "1 damaged, not listed" in page and "20261128-100000-aaaaaa" in page
    status, page = get(url.rstrip("/") + "/run/20261128-100000-aaaaaa")
    assert status == 422 and "is damaged" in page and "Fix:" in page
