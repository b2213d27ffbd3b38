"""How long the dashboard's job page takes to render a big model's fusion graph in a real browser.

Starts `kiln serve` (embedded), compiles MODEL once, signs in with headless Chromium (Debian's
chromium and chromium-driver, through Selenium) and loads the job page LOADS times. For each load
it reads, from the page itself, the time from the start of navigation until the fusion graph was
drawn (`data-ready-at`, performance.now() at the end of drawing) and how long drawing took
(`data-render-ms`). Prints the model's ops, blocks and edges, the page's size, and the median and
worst of both; the goal is a page ready in under 2 s for MobileBERT (~1,700 ops after rewriting).

    python bench/zoo.py --size full --models mobilebert     # bench/models/mobilebert.onnx
    python bench/dashboard.py [--model bench/models/mobilebert.onnx] [--loads 5]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.client import KilnClient  # noqa: E402
from tests.service.stack import EmbeddedStack  # noqa: E402


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def wait(driver, selector: str, timeout: float = 120):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, selector))[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "bench" / "models" / "mobilebert.onnx")
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--screenshot", type=Path, help="save the last load's page as a PNG")
    args = parser.parse_args()
    if not args.model.is_file():
        print(f"no model at {args.model}: run `python bench/zoo.py --size full --models "
              f"mobilebert` first (or pass --model)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kiln-bench-dashboard-") as tmp, \
            EmbeddedStack(Path(tmp), concurrency=1) as stack:
        stack.start()
        with KilnClient(stack.url, stack.api_key, timeout=600) as client:
            started = time.perf_counter()
            model = client.upload_model(args.model)
            job = client.wait(client.submit(model["id"])["id"], timeout=3600)
            compile_s = time.perf_counter() - started
            if job["state"] != "succeeded":
                print(f"the compile {job['state']}: {job.get('error')}", file=sys.stderr)
                return 1
            plan = client.http.get(f"/v1/jobs/{job['id']}/plan").json()
        driver = browser()
        try:
            driver.get(f"{stack.url}/signin")
            wait(driver, "#api_key").send_keys(stack.api_key)
            wait(driver, "#signin").click()
            wait(driver, "#upload")
            ready, drawing = [], []
            for _ in range(args.loads):
                driver.get(f"{stack.url}/jobs/{job['id']}")
                graph = wait(driver, '#graph[data-rendered="1"]')
                ready.append(float(graph.get_attribute("data-ready-at")) / 1e3)
                drawing.append(float(graph.get_attribute("data-render-ms")) / 1e3)
            page_bytes = len(driver.page_source.encode())
            if args.screenshot:
                driver.execute_script("window.scrollTo(0, document.getElementById('graph-panel')"
                                      ".getBoundingClientRect().top + window.scrollY - 300)")
                driver.save_screenshot(str(args.screenshot))
        finally:
            driver.quit()
    print(f"model {args.model.name}: {len(plan['ops'])} ops, {len(plan['blocks'])} blocks, "
          f"{len(plan['edges'])} edges, {len(plan['decisions'])} decisions "
          f"(compiled in {compile_s:.1f} s)")
    print(f"job page: {page_bytes / 1024:.0f} KiB of HTML")
    print(f"page ready (navigation start -> graph drawn): median {statistics.median(ready):.3f} s, "
          f"worst {max(ready):.3f} s over {args.loads} loads (goal < 2 s)")
    print(f"drawing the graph: median {statistics.median(drawing):.3f} s, worst {max(drawing):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
