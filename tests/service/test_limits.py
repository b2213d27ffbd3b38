"""Per-tenant limits against real service processes: a token bucket shared by every API process
(429 with Retry-After), caps on unfinished jobs and open event streams, a quota of stored bytes.

Embedded (`kiln serve`, SQLite) and scale-out (two uvicorn processes on one PostgreSQL, no
workers, so that jobs stay queued)."""
from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.service.stack import (REPO, EmbeddedStack, ScaleOutStack, create_database,
                                 drop_database, free_port, postgres_available, redis_available)

ZOO = REPO / "tests" / "fixtures" / "zoo"
RATE, BURST = 4, 12
LIMITS = {"KILN_RATE_LIMIT_PER_SECOND": str(RATE), "KILN_RATE_LIMIT_BURST": str(BURST),
          "KILN_MAX_ACTIVE_JOBS": "2", "KILN_MAX_EVENT_STREAMS": "2",
          "KILN_MAX_STORED_BYTES": str((ZOO / "tinybert.onnx").stat().st_size
                                       + (ZOO / "lstm.onnx").stat().st_size + 1000)}


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    stack = EmbeddedStack(tmp_path_factory.mktemp("limits-embedded"), concurrency=1, env=LIMITS)
    try:
        stack.start()
        stack.urls = [stack.url]
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def scaleout(tmp_path_factory):
    if not (postgres_available() and redis_available()):
        pytest.skip("PostgreSQL (127.0.0.1:5432) and Redis (127.0.0.1:6379) are needed")
    url = create_database()
    stack = ScaleOutStack(tmp_path_factory.mktemp("limits-scaleout"), url, workers=0, env=LIMITS)
    try:
        stack.start()
        port = free_port()
        stack.spawn("api2", [sys.executable, "-m", "uvicorn", "--factory", "service.app:create_app",
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"])
        stack.urls = [stack.url, f"http://127.0.0.1:{port}"]
        stack.wait_ready(url=stack.urls[1])
        stack.api_key = stack.create_key("acme")
        yield stack
    finally:
        stack.stop()
        drop_database(url)


def _refill() -> None:
    time.sleep(BURST / RATE + 0.5)


def _clients(stack) -> list[httpx.Client]:
    return [httpx.Client(base_url=u, headers={"Authorization": f"Bearer {stack.api_key}"},
                         timeout=30) for u in stack.urls]


def _burst_is_shared(stack) -> None:
    """3×BURST requests spread over every API process: about BURST pass, whatever the number of
    processes, and each refusal is a 429 problem with a Retry-After."""
    _refill()
    clients = _clients(stack)
    started = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda i: clients[i % len(clients)].get("/v1/jobs"),
                                range(3 * BURST)))
    elapsed = time.monotonic() - started
    passed = [r for r in replies if r.status_code == 200]
    limited = [r for r in replies if r.status_code == 429]
    assert len(passed) + len(limited) == len(replies), {r.status_code for r in replies}
    assert BURST <= len(passed) <= BURST + RATE * elapsed + 1, (len(passed), elapsed)
    assert limited, "no request was limited"
    for r in limited:
        assert r.headers["content-type"] == "application/problem+json"
        assert 1 <= int(r.headers["Retry-After"]) <= 2
        assert "requests" in r.json()["detail"]
    time.sleep(int(limited[0].headers["Retry-After"]))
    assert clients[-1].get("/v1/jobs").status_code == 200
    for c in clients:
        c.close()


def test_embedded_rate_limit(embedded):
    _burst_is_shared(embedded)


def test_scaleout_rate_limit_is_shared_by_api_processes(scaleout):
    _burst_is_shared(scaleout)


def test_embedded_stored_bytes_quota(embedded):
    _refill()
    with httpx.Client(base_url=embedded.url, timeout=30,
                      headers={"Authorization": f"Bearer {embedded.api_key}"}) as client:
        def upload(name: str):
            return client.post("/v1/models", content=(ZOO / f"{name}.onnx").read_bytes(),
                               headers={"Content-Type": "application/octet-stream"})

        assert upload("tinybert").status_code == 201
        assert upload("lstm").status_code == 201
        over = upload("resnet50")
        assert over.status_code == 413, over.text
        assert "stored" in over.json()["detail"] and "KILN_MAX_STORED_BYTES" in over.json()["detail"]
        assert upload("tinybert").status_code == 200  # the same bytes again take no room
        assert len(client.get("/v1/models").json()) == 2


def test_scaleout_active_jobs_streams_and_idempotency(scaleout):
    """No worker runs: jobs stay queued and their event streams stay open."""
    _refill()
    first, second = _clients(scaleout)
    model = first.post("/v1/models", content=(ZOO / "lstm.onnx").read_bytes(),
                       headers={"Content-Type": "application/octet-stream"}).json()
    retry = {"Idempotency-Key": "nightly-7"}
    jobs = [c.post("/v1/jobs", json={"model_id": model["id"]}, headers=retry).json()["id"]
            for c in (first, second)]
    assert jobs[0] == jobs[1], "the key is honoured across API processes"
    jobs.append(second.post("/v1/jobs", json={"model_id": model["id"]}).json()["id"])
    over = first.post("/v1/jobs", json={"model_id": model["id"]})
    assert over.status_code == 429, over.text
    assert "2 unfinished jobs" in over.json()["detail"] and "Retry-After" in over.headers

    streams = [c.stream("GET", f"/v1/jobs/{jobs[0]}/events", timeout=httpx.Timeout(30))
               for c in (first, second)]
    opened = [s.__enter__() for s in streams]
    assert all(r.status_code == 200 for r in opened)
    third = first.get(f"/v1/jobs/{jobs[2]}/events")
    assert third.status_code == 429 and "event streams" in third.json()["detail"]
    streams[0].__exit__(None, None, None)
    deadline = time.monotonic() + 10  # the server ends a stream when its client goes away
    while not _stream_opens(second, jobs[2]):
        assert time.monotonic() < deadline, "a closed stream still counts"
        time.sleep(0.3)
    streams[1].__exit__(None, None, None)
    assert second.post(f"/v1/jobs/{jobs[0]}/cancel").status_code == 202
    fourth = second.post("/v1/jobs", json={"model_id": model["id"]})
    assert fourth.status_code == 202, "a cancelled job frees its place"
    first.close()
    second.close()


def _stream_opens(client: httpx.Client, job_id: str) -> bool:
    with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        return response.status_code == 200


def test_a_request_with_an_earlier_clock_does_not_turn_the_bucket_back(database_url, monkeypatch):
    """Two processes' requests can reach the database out of clock order; the late one with the
    earlier clock must not move the bucket's time back, or the interval is refilled twice."""
    from service import limits
    from service.db import database
    from service.limits.service import take_token
    from service.migrate import upgrade
    from service.tenants.service import create_tenant

    upgrade(database_url)
    db = database(database_url)
    tenant = create_tenant(db, "acme")
    clock = iter([100.0, 99.0, 100.0])
    monkeypatch.setattr(limits.service.time, "time", lambda: next(clock))
    waits = [take_token(db, tenant.id, rate=1.0, burst=2) for _ in range(3)]
    assert waits[:2] == [0.0, 0.0] and waits[2] > 0  # a burst of 2 at t=100, not 3


def test_a_bucket_made_between_the_update_and_the_read_still_gives_its_token(database_url,
                                                                            monkeypatch):
    """PostgreSQL reads each statement's own snapshot: another API process can make the bucket
    after this request's UPDATE found none and before it reads the bucket. The request must take
    its token from that bucket, not pass without one (an extra request in a fresh burst)."""
    if not database_url.startswith("postgresql"):
        pytest.skip("SQLite serializes the write transactions: nothing comes in between")
    from sqlalchemy.orm import Session

    from service.db import Database, database
    from service.limits.service import take_token
    from service.limits.tables import RateBucket
    from service.migrate import upgrade
    from service.tenants.service import create_tenant

    upgrade(database_url)
    db = database(database_url)
    tenant = create_tenant(db, "acme")
    other_process = Database(database_url)
    real_get = Session.get

    def bucket_made_meanwhile(session, entity, ident, *args, **kwargs):
        if entity is RateBucket and not made:
            made.append(True)
            with other_process.write() as s:
                s.add(RateBucket(tenant_id=tenant.id, tokens=1.0, updated_at=time.time()))
        return real_get(session, entity, ident, *args, **kwargs)

    made: list[bool] = []
    monkeypatch.setattr(Session, "get", bucket_made_meanwhile)
    try:
        assert take_token(db, tenant.id, rate=0.001, burst=2) == 0.0
        assert made, "the request did not read the bucket after its UPDATE"
        with db.read() as s:
            assert s.get(RateBucket, tenant.id).tokens < 1.0, "the request took no token"
        assert take_token(db, tenant.id, rate=0.001, burst=2) > 0
    finally:
        other_process.dispose()
