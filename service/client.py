"""A small Python client of the Kiln service (used by `kiln submit` and the tests).

    client = KilnClient("http://127.0.0.1:8000", api_key)
    model = client.upload_model("tinybert.onnx")
    job = client.submit(model["id"], target="host", tune="quick", tune_budget_s=30)
    job = client.wait(job["id"], on_progress=print)
    client.download_artifact(job["id"], "tinybert.kiln")
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

TERMINAL = ("succeeded", "failed", "cancelled")


def describe_progress(job: dict[str, Any]) -> str:
    """A job's progress in one line: `queued (2 jobs ahead)`, `running plan: latency of … (12)`,
    `running tune: fused_matmul_add (12/38)`; the percentage is the caller's to draw."""
    state = job["state"]
    if state == "queued" and job.get("queue_position"):
        ahead = job["queue_position"] - 1
        return f"queued ({ahead} job{'s' if ahead != 1 else ''} ahead)" if ahead else \
            "queued (next)"
    if state != "running" or not job.get("stage"):
        return state
    text = f"running {job['stage']}"
    step = job.get("step")
    if step:
        count = f"{step['done']}/{step['total']}" if step.get("total") else f"{step['done']}"
        text += f": {step['text']} ({count})" if step.get("text") else f" ({count})"
    return text


class ServiceError(Exception):
    """The service refused a request; `detail` is its problem+json message."""

    def __init__(self, status: int, title: str, detail: str):
        super().__init__(f"{status} {title}: {detail}")
        self.status, self.title, self.detail = status, title, detail


class KilnClient:
    def __init__(self, url: str, api_key: str | None, timeout: float = 60.0,
                 http: httpx.Client | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = http or httpx.Client(base_url=url.rstrip("/"), headers=headers,
                                         timeout=httpx.Timeout(timeout, connect=10.0))

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "KilnClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests --------------------------------------------------------------------------

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.is_success:
            return response
        try:
            body = response.json()
            title, detail = body.get("title", response.reason_phrase), body.get("detail", "")
        except ValueError:
            title, detail = response.reason_phrase, response.text[:500]
        raise ServiceError(response.status_code, title, detail)

    def health(self) -> dict[str, Any]:
        return self._check(self.http.get("/v1/health")).json()

    def upload_model(self, path: str | Path) -> dict[str, Any]:
        path = Path(path)
        with path.open("rb") as f:
            response = self.http.post("/v1/models", content=f, params={"filename": path.name},
                                      headers={"Content-Type": "application/octet-stream"})
        return self._check(response).json()

    def submit(self, model_id: str, target: str = "host", partitioner: str = "dnnfusion",
               shapes: dict[str, list[int]] | None = None, rewrite: bool = True,
               tune: str = "reuse", tune_budget_s: float | None = None) -> dict[str, Any]:
        body = {"model_id": model_id, "target": target, "partitioner": partitioner,
                "shapes": {k: list(v) for k, v in (shapes or {}).items()}, "rewrite": rewrite,
                "tune": tune}
        if tune_budget_s is not None:
            body["tune_budget_s"] = tune_budget_s
        return self._check(self.http.post("/v1/jobs", json=body)).json()

    def model(self, model_id: str) -> dict[str, Any]:
        return self._check(self.http.get(f"/v1/models/{model_id}")).json()

    def models(self, limit: int = 100) -> list[dict[str, Any]]:
        return self._check(self.http.get("/v1/models", params={"limit": limit})).json()

    def job(self, job_id: str) -> dict[str, Any]:
        return self._check(self.http.get(f"/v1/jobs/{job_id}")).json()

    def jobs(self, state: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        params = {"limit": limit} | ({"state": state} if state else {})
        return self._check(self.http.get("/v1/jobs", params=params)).json()

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._check(self.http.post(f"/v1/jobs/{job_id}/cancel")).json()

    def report(self, job_id: str) -> dict[str, Any]:
        return self._check(self.http.get(f"/v1/jobs/{job_id}/report")).json()

    def events(self, job_id: str, read_timeout: float | None = None,
               until: Callable[[], object] | None = None) -> Iterator[dict[str, Any]]:
        """The job's server-sent events: a job dict per change, until it is finished.

        `read_timeout`: the longest wait for the next line (an event or a keep-alive) before
        httpx.ReadTimeout; `until()` is called after every line (it raises to stop)."""
        timeout = httpx.Timeout(read_timeout, connect=min(10.0, read_timeout or 10.0))
        with self.http.stream("GET", f"/v1/jobs/{job_id}/events", timeout=timeout) as response:
            self._check_stream(response)
            event, data = "message", []
            for line in response.iter_lines():
                if until:
                    until()
                if line == "":
                    if data and event == "job":
                        yield json.loads("\n".join(data))
                    if event == "end":
                        return
                    event, data = "message", []
                elif line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].lstrip())

    def _check_stream(self, response: httpx.Response) -> None:
        if not response.is_success:
            response.read()
            self._check(response)

    def wait(self, job_id: str, on_progress: Callable[[dict[str, Any]], None] | None = None,
             timeout: float | None = None) -> dict[str, Any]:
        """Follow the job's events until it is finished; return the job.

        TimeoutError when it is not finished after `timeout` seconds: the clock is read after
        every line of the stream, and no read waits more than a tenth of the timeout (at least
        1 s), so the wait ends at most that much late."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            if deadline is None:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"job {job_id} did not finish in {timeout:g} s")
            return remaining

        while True:
            remaining = left()
            read = None if remaining is None else min(remaining, max(1.0, timeout / 10))
            try:
                for job in self.events(job_id, read_timeout=read, until=left):
                    if on_progress:
                        on_progress(job)
            except httpx.TransportError:  # the stream broke or went quiet: poll, follow again
                time.sleep(min(0.5, left() or 0.5))
            limit = left()
            job = self._check(self.http.get(f"/v1/jobs/{job_id}", timeout=httpx.USE_CLIENT_DEFAULT
                                            if limit is None else limit)).json()
            if job["state"] in TERMINAL:
                return job

    def profile(self, job_id: str, device: str = "", runs: int = 20, warmup: int = 3,
                repeats: int = 3) -> dict[str, Any]:
        """Start a profile job: run the job's artifact on a device matching `device`."""
        body = {"device": device, "runs": runs, "warmup": warmup, "repeats": repeats}
        return self._check(self.http.post(f"/v1/jobs/{job_id}/profile", json=body)).json()

    def profile_run(self, job_id: str, run_id: str) -> dict[str, Any]:
        return self._check(self.http.get(f"/v1/jobs/{job_id}/profile/{run_id}")).json()

    def wait_profile(self, job_id: str, run_id: str, timeout: float | None = None,
                     poll: float = 0.5) -> dict[str, Any]:
        """Poll a profile run until it has succeeded or failed; return it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            run = self.profile_run(job_id, run_id)
            if run["state"] in ("succeeded", "failed"):
                return run
            if deadline and time.monotonic() > deadline:
                raise TimeoutError(f"profile run {run_id} did not finish in {timeout} s")
            time.sleep(poll)

    def download_artifact(self, job_id: str, dest: str | Path) -> Path:
        """Stream the artifact to `dest` (written under a temporary name, then renamed)."""
        dest = Path(dest)
        partial = dest.with_name(f".{dest.name}.{os.getpid()}.part")
        try:
            with self.http.stream("GET", f"/v1/jobs/{job_id}/artifact") as response:
                self._check_stream(response)
                with partial.open("wb") as out:
                    for chunk in response.iter_bytes(1 << 20):
                        out.write(chunk)
            os.replace(partial, dest)
        finally:
            partial.unlink(missing_ok=True)
        return dest
