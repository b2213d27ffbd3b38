"""Load on the compilation service: submit latency at 50 concurrent clients, jobs per minute.

For each mode, starts the real service (embedded: `kiln serve --workers 2`, SQLite and the file
broker; scale-out: uvicorn and two `celery worker` processes on PostgreSQL and Redis of this
machine), uploads the tiny zoo models, compiles each once to warm the kernel cache, then lets
CLIENTS threads (each its own HTTP client) submit JOBS_PER_CLIENT jobs each at the same moment.
It prints the latency of POST /v1/jobs (p50, p99) and the jobs completed per minute, from the
first submit to the last job finished.

    python bench/service_load.py [--modes embedded,scaleout] [--clients 50] [--jobs-per-client 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.client import KilnClient  # noqa: E402
from tests.service.stack import (EmbeddedStack, ScaleOutStack, create_database,  # noqa: E402
                                 drop_database)

ZOO = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "zoo"
MODELS = ("tinybert", "resnet50", "lstm", "gpt2")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def measure(stack, clients: int, per_client: int) -> dict:
    with KilnClient(stack.url, stack.api_key) as client:
        model_ids = [client.upload_model(ZOO / f"{m}.onnx")["id"] for m in MODELS]
        for model_id in model_ids:  # warm the kernel cache: steady state, not first compiles
            job = client.wait(client.submit(model_id)["id"], timeout=900)
            assert job["state"] == "succeeded", job

    latencies: list[float] = []
    job_ids: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)

    def run(i: int) -> None:
        with KilnClient(stack.url, stack.api_key) as c:
            c.health()  # connect before the clock starts
            barrier.wait()
            for k in range(per_client):
                start = time.perf_counter()
                job = c.submit(model_ids[(i + k) % len(model_ids)])
                with lock:
                    latencies.append(time.perf_counter() - start)
                    job_ids.append(job["id"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    total = clients * per_client
    with KilnClient(stack.url, stack.api_key) as client:
        while True:
            jobs = {j["id"]: j for j in client.jobs(limit=1000)}
            finished = [jobs[i] for i in job_ids if jobs[i]["state"] in ("succeeded", "failed",
                                                                         "cancelled")]
            if len(finished) == total:
                break
            time.sleep(0.2)
    elapsed = time.perf_counter() - started
    failed = sum(1 for j in finished if j["state"] != "succeeded")
    return {"submits": len(latencies), "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * percentile(latencies, 99), "jobs": total, "failed": failed,
            "elapsed_s": elapsed, "jobs_per_min": 60 * (total - failed) / elapsed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="embedded,scaleout")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--jobs-per-client", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for mode in args.modes.split(","):
        folder = Path(tempfile.mkdtemp(prefix=f"kiln-load-{mode}-"))
        url = None
        if mode == "embedded":
            stack = EmbeddedStack(folder, concurrency=2)
        elif mode == "scaleout":
            url = create_database()
            stack = ScaleOutStack(folder, url, workers=2)
        else:
            parser.error(f"unknown mode {mode!r}")
        try:
            stack.start()
            if mode == "scaleout":
                stack.api_key = stack.create_key("bench")
            print(f"{mode}: service at {stack.url}, logs in {folder}", file=sys.stderr)
            rows.append((mode, measure(stack, args.clients, args.jobs_per_client)))
        finally:
            stack.stop()
            if url:
                drop_database(url)
    print(f"\n{'mode':<10} {'clients':>7} {'submits':>7} {'submit p50':>11} {'submit p99':>11} "
          f"{'workers':>7} {'jobs':>5} {'failed':>6} {'elapsed':>8} {'jobs/min':>9}")
    for mode, r in rows:
        print(f"{mode:<10} {args.clients:>7} {r['submits']:>7} {r['p50_ms']:>9.1f}ms "
              f"{r['p99_ms']:>9.1f}ms {2:>7} {r['jobs']:>5} {r['failed']:>6} "
              f"{r['elapsed_s']:>7.1f}s {r['jobs_per_min']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
