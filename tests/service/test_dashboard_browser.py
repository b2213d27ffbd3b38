"""The dashboard driven in a real headless Chromium (Debian's chromium + chromedriver, Selenium).

One `kiln serve` and one real device agent (this machine's CPU, named browser-cpu) serve the whole
module; the tests run in order, as a user would: sign in, upload a model, watch it compile, open
its graph, profile it on the agent's device, look at devices and profiles, sign out. Assertions
are on what the page shows, compared with what `/v1` returns. Screenshots go to
tests/artifacts/screenshots/ (git-ignored).
"""
from __future__ import annotations

import shutil
import sys

import httpx
import onnx
import pytest

from service.dashboard.router import _bytes, duration
from tests.service.stack import REPO, EmbeddedStack, kiln_cli
from tests.service.test_farm_api import mlp_model

SHOTS = REPO / "tests" / "artifacts" / "screenshots"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
XSS = "<script>alert(1)</script>"

pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="Debian's chromium and chromium-driver are needed")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """(stack, agent process, API client) with an agent measuring on this machine."""
    tmp = tmp_path_factory.mktemp("dashboard")
    stack = EmbeddedStack(tmp / "stack", concurrency=1).start()
    assert f"dashboard at {stack.url}/" in stack.log("serve")  # `kiln serve` says where it is
    token = kiln_cli(stack.env, "admin", "create-agent", "browser-lab").strip()
    config = tmp / "agent.toml"
    config.write_text(f'server = "{stack.url}"\ntoken = "{token}"\nwork_dir = "{tmp / "agent"}"\n'
                      'local_name = "browser-cpu"\npoll_interval = 0.3\nheartbeat_interval = 2\n')
    agent = stack.spawn("agent", [sys.executable, "-m", "device_agents.cli", "--config",
                                  str(config)])
    api = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.api_key}"},
                       timeout=30)
    try:
        yield stack, agent, api
    finally:
        api.close()
        stack.stop()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(0)
    SHOTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def wait_for(driver, condition, timeout: float = 60, what: str = "the page"):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(
        lambda d: condition(d), message=f"timed out waiting for {what}")


def css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def shot(driver, name: str) -> None:
    driver.save_screenshot(str(SHOTS / f"{name}.png"))


def no_alert(driver) -> None:
    from selenium.common.exceptions import NoAlertPresentException

    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text


def sign_in(driver, url: str, key: str) -> None:
    driver.get(f"{url}/jobs")
    wait_for(driver, lambda d: css(d, "#api_key"), what="the sign-in form")
    css(driver, "#api_key")[0].send_keys(key)
    css(driver, "#signin")[0].click()


def test_sign_in_refuses_a_wrong_key_and_keeps_v1_on_bearer_keys(site, browser):
    stack, _, _ = site
    sign_in(browser, stack.url, "kiln_000000000000_wrong")
    error = wait_for(browser, lambda d: css(d, "#signin-error"), what="the sign-in error")[0]
    assert "not valid" in error.text
    sign_in(browser, stack.url, stack.api_key)
    wait_for(browser, lambda d: d.current_url.endswith("/jobs") and css(d, "#upload"),
             what="the jobs page")
    cookie = browser.get_cookie("kiln_session")
    assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict"
    # the cookie does not open /v1, and a POST without the CSRF token is refused
    status = browser.execute_async_script(
        "const done = arguments[0]; Promise.all([fetch('/v1/jobs'), fetch('/jobs/x/cancel', "
        "{method: 'POST'})]).then(rs => done(rs.map(r => r.status)));")
    assert status == [401, 403]


def test_upload_watch_it_finish_and_open_its_graph(site, browser, tmp_path):
    stack, _, api = site
    model = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), str(model))
    browser.get(f"{stack.url}/jobs")
    css(browser, "#model-file")[0].send_keys(str(model))
    css(browser, "#submit-model")[0].click()
    row = wait_for(browser, lambda d: css(d, "tr[data-job]"), what="the new job's row")[0]
    job_id = row.get_attribute("data-job")
    assert "mlp.onnx" in row.text
    # the row turns succeeded through the tenant's event stream, without a reload
    wait_for(browser, lambda d: css(d, f'tr[data-job="{job_id}"][data-state="succeeded"]'),
             timeout=120, what="the job to succeed")
    assert "succeeded" in css(browser, f'tr[data-job="{job_id}"] .state')[0].text
    shot(browser, "jobs")

    css(browser, f'tr[data-job="{job_id}"] .model a')[0].click()
    graph = wait_for(browser, lambda d: css(d, '#graph[data-rendered="1"]'), what="the graph")[0]
    report = api.get(f"/v1/jobs/{job_id}/report").json()
    plan = api.get(f"/v1/jobs/{job_id}/plan").json()
    assert css(browser, "#kernels-after")[0].text == str(report["kernels"])
    assert css(browser, "#ops-before")[0].text.startswith(str(report["ops_before"]))
    assert len(css(browser, "#graph g.op")) == len(plan["ops"])
    assert len(css(browser, "#graph rect.block")) == len(plan["blocks"])
    assert len(css(browser, "#graph line.edge")) == len(plan["edges"])
    assert graph.get_attribute("data-ops") == str(len(plan["ops"]))
    # the op named <script>alert(1)</script> is text in its tooltip, never markup
    titles = [t.get_attribute("textContent") for t in css(browser, "#graph g.op title")]
    assert any(XSS in t for t in titles)
    no_alert(browser)
    assert css(browser, "#download")[0].get_attribute("href").endswith(f"/jobs/{job_id}/artifact")
    shot(browser, "job-graph")


def test_profile_on_the_local_agent_shows_latency_bars(site, browser):
    stack, _, api = site
    job_id = api.get("/v1/jobs").json()[0]["id"]
    wait_for(browser, lambda d: any(x["name"] == "browser-cpu" and x["online"]
                                    for x in api.get("/v1/devices").json()),
             what="the agent's device to come online")
    browser.get(f"{stack.url}/jobs/{job_id}")
    css(browser, "#profile-device")[0].send_keys("name:browser-cpu")
    css(browser, "#run-profile")[0].click()
    wait_for(browser, lambda d: css(d, "#latency-bars .bar-row"), timeout=120,
             what="the latency bars")
    run = api.get(f"/v1/jobs/{job_id}/profile").json()[0]
    assert run["state"] == "succeeded" and run["via"] == "agent"
    assert run["result"]["device"]["name"] == "browser-cpu"
    rows = css(browser, "#latency-bars .bar-row")
    assert [r.get_attribute("data-kernel") for r in rows] == \
        [k["symbol"] for k in run["result"]["kernels"]]
    for row, kernel in zip(rows, run["result"]["kernels"]):
        assert row.find_element("css selector", ".bar-value").text == duration(kernel["median_s"])
    assert "browser-cpu" in css(browser, "#profile-runs")[0].text
    rss = run["result"]["memory"]["measured_peak_rss_bytes"]
    assert run["result"]["memory"]["peak_bytes"] < rss  # the planned tensors plus the runner
    assert css(browser, "#profile-rss")[0].text == _bytes(rss)
    width = css(browser, "#latency-bars .bar-median")[0].size["width"]
    assert width > 0  # the script sized the bar
    shot(browser, "job-profile")


def test_devices_and_profiles_pages(site, browser):
    stack, _, api = site
    browser.get(f"{stack.url}/devices")
    table = wait_for(browser, lambda d: css(d, "#devices"), what="the devices table")[0]
    row = next(r for r in css(browser, "#devices tbody tr") if "browser-cpu" in r.text)
    assert row.find_element("css selector", ".state").text in ("online", "busy")
    field = css(browser, "#device-filter")[0]
    field.send_keys("kind:phone")
    field.submit()
    wait_for(browser, lambda d: "No device matches." in css(d, "#devices")[0].text,
             what="the filtered table")
    browser.get(f"{stack.url}/devices?device={XSS}")
    assert XSS in css(browser, "#device-filter")[0].get_attribute("value")
    assert XSS in css(browser, "#devices-error")[0].text  # shown as text
    no_alert(browser)
    device = next(d for d in api.get("/v1/devices").json() if d["name"] == "browser-cpu")
    browser.get(f"{stack.url}/devices/{device['id']}")
    assert css(browser, "#device-name")[0].text == "browser-cpu"
    assert "done" in css(browser, "#tasks")[0].text
    shot(browser, "device")

    browser.get(f"{stack.url}/profiles?device=name:browser-cpu")
    summary = api.get("/v1/profiles/summary").json()
    assert css(browser, "#entry-count")[0].text == str(summary["entries"])
    entries = css(browser, "#entries tbody tr")
    assert entries and "browser-cpu" in entries[0].text
    entries[0].find_element("css selector", "a").click()
    wait_for(browser, lambda d: css(d, "#spread rect.span"), what="the latency plot")
    shot(browser, "profiles")


def test_api_docs_load_offline_and_sign_out(site, browser):
    stack, _, _ = site
    browser.get(f"{stack.url}/v1/docs")
    title = wait_for(browser, lambda d: css(d, ".swagger-ui .info .title"), what="Swagger UI")[0]
    assert "Kiln compilation service" in title.text
    assert all("/static/" in (s.get_attribute("src") or "/static/")
               for s in css(browser, "script"))  # nothing from another origin
    browser.get(f"{stack.url}/jobs")
    css(browser, ".signout button")[0].click()
    wait_for(browser, lambda d: css(d, "#api_key"), what="the sign-in page")
    browser.get(f"{stack.url}/jobs")
    wait_for(browser, lambda d: "/signin" in d.current_url, what="the redirect to sign-in")
