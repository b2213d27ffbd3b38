"""The dashboard's pages (server-rendered Jinja2, autoescaped) and its few JSON/SSE helpers.

Every page needs a session (service.dashboard.auth); every POST its CSRF token. Pages read the
same service functions as `/v1`, scoped to the session's tenant. Responses carry a Content
Security Policy that allows only Kiln's own scripts and styles: user text that escaped the
templates' escaping still could not run.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, StreamingResponse
from fastapi.templating import Jinja2Templates
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from service.dashboard import auth
from service.devices import farm
from service.devices import selector as sel
from service.jobs import service as jobs
from service.jobs.schemas import JobCreate
from service.jobs.tables import TERMINAL, Job
from service.models import service as models
from service.models.tables import ModelRecord
from service.problems import APIError
from service.profiles import library, runs
from service.profiles.tables import JobPlan

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=str(HERE / "templates"))
router = APIRouter(include_in_schema=False)
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'")
PAGE_SIZE = 50


# --- formatting filters --------------------------------------------------------------------------

def duration(seconds: float | None) -> str:
    """Seconds in the unit that reads best: 12.3 µs, 4.56 ms, 1.234 s."""
    if seconds is None:
        return "–"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.3f} s"


def _bytes(n: int | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


templates.env.filters.update(dur=duration, bytes=_bytes, short=lambda s, n=12: (s or "")[:n])


def render(request: Request, name: str, session: auth.Session | None, status: int = 200,
           **context: Any):
    response = templates.TemplateResponse(request, name, {"session": session, **context},
                                          status_code=status)
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    return response


def _db(request: Request):
    return request.app.state.db


def _session(request: Request) -> auth.Session:
    return auth.session_of(_db(request), request)


def install(app) -> None:
    """Mount the routes, the static files and the sign-in redirect."""
    from fastapi.staticfiles import StaticFiles

    app.mount("/static/dashboard", StaticFiles(directory=str(HERE / "static")), name="dashboard")
    app.include_router(router)

    @app.exception_handler(auth.SignInRequired)
    async def _to_signin(request: Request, _exc):
        return RedirectResponse(f"/signin?next={quote(request.url.path)}", status_code=303)

    @app.exception_handler(auth.CsrfError)
    async def _csrf(request: Request, exc):
        return JSONResponse({"detail": f"refused: {exc}; reload the page"}, status_code=403)


# --- sign-in -------------------------------------------------------------------------------------

def _cookie(response, name: str, value: str, request: Request, max_age: int | None) -> None:
    secure = request.app.state.settings.cookie_secure
    response.set_cookie(name, value, max_age=max_age, httponly=True, secure=secure,
                        samesite="strict", path="/")


@router.get("/")
def home(request: Request):
    try:
        _session(request)
    except auth.SignInRequired:
        return RedirectResponse("/signin", status_code=303)
    return RedirectResponse("/jobs", status_code=303)


def _signin_page(request: Request, error: str | None = None, status: int = 200):
    csrf = auth.new_signin_csrf()
    next_path = request.query_params.get("next", "/jobs")
    response = render(request, "signin.html", None, status, csrf=csrf, error=error,
                      next=next_path if next_path.startswith("/") and not
                      next_path.startswith("//") else "/jobs")
    _cookie(response, auth.SIGNIN_CSRF_COOKIE, csrf, request, 600)
    return response


@router.get("/signin")
def signin_form(request: Request):
    return _signin_page(request)


@router.post("/signin")
async def signin(request: Request):
    form = await auth.read_form(request)
    auth.check_signin_csrf(request, form)
    signed = await run_in_threadpool(auth.sign_in, _db(request), form.get("api_key", ""))
    if signed is None:
        return _signin_page(request, "That API key is not valid (or was revoked).", 401)
    token, _session_ = signed
    target = form.get("next", "/jobs")
    if not target.startswith("/") or target.startswith("//"):
        target = "/jobs"
    response = RedirectResponse(target, status_code=303)
    _cookie(response, auth.SESSION_COOKIE, token, request, auth.SESSION_HOURS * 3600)
    response.delete_cookie(auth.SIGNIN_CSRF_COOKIE, path="/")
    return response


@router.post("/signout")
async def signout(request: Request):
    session = await run_in_threadpool(_session, request)
    auth.check_csrf(session, request, await auth.read_form(request))
    await run_in_threadpool(auth.sign_out, _db(request), request)
    response = RedirectResponse("/signin", status_code=303)
    response.delete_cookie(auth.SESSION_COOKIE, path="/")
    return response


# --- jobs ----------------------------------------------------------------------------------------

def _job_rows(db, tenant_id: str, state: str | None, text: str | None) -> list[dict[str, Any]]:
    query = (select(Job, ModelRecord.filename).join(ModelRecord, ModelRecord.id == Job.model_id)
             .where(Job.tenant_id == tenant_id))
    if state:
        query = query.where(Job.state == state)
    if text:
        query = query.where(ModelRecord.filename.contains(text))
    with db.read() as s:
        rows = s.execute(query.order_by(Job.created_at.desc(), Job.id).limit(200)).all()
    return [{"job": j, "model": name} for j, name in rows]


def job_event(job: Job) -> dict[str, Any]:
    return {"id": job.id, "state": job.state, "stage": job.stage, "progress": job.progress,
            "error": job.error}


@router.get("/jobs")
def jobs_page(request: Request, state: str | None = None, q: str | None = None):
    session = _session(request)
    from kiln.plan import partitioner_names
    from kiln.target import TARGET_NAMES

    rows = _job_rows(_db(request), session.tenant_id, state or None, q or None)
    return render(request, "jobs.html", session, rows=rows, state=state or "", q=q or "",
                  targets=TARGET_NAMES, partitioners=partitioner_names(),
                  states=("queued", "running", "succeeded", "failed", "cancelled"))


@router.get("/jobs/events")
async def jobs_events(request: Request):
    """One server-sent event stream per tenant: `event: job` with a job's id, state, stage and
    progress whenever one of the tenant's 200 latest jobs changes (or appears)."""
    session = await run_in_threadpool(_session, request)
    db, settings = _db(request), request.app.state.settings

    def snapshot() -> dict[str, dict[str, Any]]:
        with db.read() as s:
            found = s.scalars(select(Job).where(Job.tenant_id == session.tenant_id)
                              .order_by(Job.created_at.desc()).limit(200))
            return {j.id: job_event(j) for j in found}

    async def stream():
        seen: dict[str, dict[str, Any]] = {}
        last = time.monotonic()
        yield "retry: 2000\n\n"
        while not await request.is_disconnected():
            now = await run_in_threadpool(snapshot)
            for job_id, event in now.items():
                if seen.get(job_id) != event:
                    yield f"event: job\ndata: {json.dumps(event)}\n\n"
                    last = time.monotonic()
            seen = now
            if time.monotonic() - last > 15:
                yield ": keepalive\n\n"
                last = time.monotonic()
            await asyncio.sleep(settings.events_poll_seconds)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.post("/jobs/upload")
async def upload(request: Request, filename: str = "model.onnx", target: str = "host",
                 partitioner: str = "dnnfusion", shapes: str = ""):
    """The upload form's script sends the file as the raw body; a model and a job are made as
    `POST /v1/models` and `POST /v1/jobs` would. `shapes`: `name=1,128 other=1,128`, for inputs
    with symbolic dimensions. JSON: {job_id} or {detail}."""
    from kiln.errors import KilnError
    from kiln.frontend import parse_shape_arg

    session = await run_in_threadpool(_session, request)
    auth.check_csrf(session, request)
    db, storage, settings = _db(request), request.app.state.storage, request.app.state.settings
    try:
        try:
            given = dict(parse_shape_arg(part) for part in shapes.split())
        except KilnError as exc:
            raise APIError(422, "Unprocessable Content",
                           str(exc).replace("--shape", "shapes")) from None
        body = JobCreate(model_id="pending", target=target, partitioner=partitioner,
                         shapes={k: list(v) for k, v in given.items()})
        upload_ = await models.receive(request.stream(), storage, settings.max_upload_bytes,
                                       filename)
        try:
            model = await run_in_threadpool(models.find_by_hash, db, session.tenant_id,
                                            upload_.sha256)
            if model is None:
                try:
                    opset, inputs = await run_in_threadpool(models.inspect, upload_.path)
                except Exception as exc:  # kiln's ModelError, or onnx's own
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    raise APIError(422, "Invalid Model", first) from None
                model, _ = await run_in_threadpool(models.record, db, storage, session.tenant_id,
                                                   upload_, opset, inputs)
        finally:
            upload_.discard()
        job = await run_in_threadpool(jobs.create, db, session.tenant_id,
                                      body.model_copy(update={"model_id": model.id}))
        request.app.state.dispatcher.enqueue(job.id)
    except APIError as exc:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status)
    except ValueError as exc:  # JobCreate's validation: unknown target or partitioner
        return JSONResponse({"detail": str(exc)}, status_code=422)
    return JSONResponse({"job_id": job.id}, status_code=201)


@router.post("/jobs/{job_id}/cancel")
async def cancel(request: Request, job_id: str):
    session = await run_in_threadpool(_session, request)
    auth.check_csrf(session, request, await auth.read_form(request))
    try:
        _job, stopped = await run_in_threadpool(jobs.cancel, _db(request), session.tenant_id,
                                                job_id)
        if stopped:
            request.app.state.dispatcher.revoke(job_id)
    except APIError as exc:
        if exc.status == 404:
            raise
    return RedirectResponse("/jobs", status_code=303)


def graph_payload(plan: JobPlan | None, lookups: dict[str, Any] | None) -> dict[str, Any] | None:
    if plan is None:
        return None
    graph = plan.graph
    return {"ops": graph["ops"], "edges": graph["edges"],
            "blocks": [{k: v for k, v in b.items() if k != "description"} for b in graph["blocks"]],
            "lookups": lookups or []}


def latency_bars(run) -> list[dict[str, Any]]:
    """The kernels of a run with their bar widths (% of the slowest p90)."""
    if run is None or not run.result:
        return []
    kernels = run.result["kernels"]
    top = max((k["p90_s"] for k in kernels), default=0) or 1
    return [{**k, "p10_pct": 100 * k["p10_s"] / top, "median_pct": 100 * k["median_s"] / top,
             "p90_pct": 100 * k["p90_s"] / top} for k in kernels]


@router.get("/jobs/{job_id}")
def job_page(request: Request, job_id: str, profile_error: str | None = None):
    session = _session(request)
    db = _db(request)
    job, artifact = jobs.get(db, session.tenant_id, job_id)
    model = models.get(db, session.tenant_id, job.model_id)
    with db.read() as s:
        plan = s.get(JobPlan, job_id) if job.state == "succeeded" else None
    lookups = library.plan(db, session.tenant_id, job_id)["lookups"] if plan else []
    profile_runs = runs.list_runs(db, session.tenant_id, job_id)
    latest = next((r for r in profile_runs if r.state == runs.DONE), None)
    report = job.report or {}
    ops = {o["id"]: o for o in plan.graph["ops"]} if plan else {}
    return render(request, "job.html", session, job=job, artifact=artifact, model=model,
                  report=report, plan=plan, ops=ops, profile_runs=profile_runs, latest=latest,
                  bars=latency_bars(latest), graph=graph_payload(plan, lookups),
                  profile_error=profile_error, terminal=job.state in TERMINAL)


@router.post("/jobs/{job_id}/profile")
async def profile(request: Request, job_id: str):
    session = await run_in_threadpool(_session, request)
    form = await auth.read_form(request)
    auth.check_csrf(session, request, form)
    db, storage = _db(request), request.app.state.storage
    try:
        body = runs.ProfileCreate(device=form.get("device", ""),
                                  runs=int(form.get("runs") or 20),
                                  repeats=int(form.get("repeats") or 3))
        run = await run_in_threadpool(runs.start, db, storage, session.tenant_id, job_id, body)
        if run.via == runs.WORKER:
            request.app.state.dispatcher.enqueue_profile(run.id)
    except APIError as exc:
        if exc.status == 404:
            raise
        return RedirectResponse(f"/jobs/{job_id}?profile_error={quote(exc.detail)}#profile",
                                status_code=303)
    except ValueError as exc:
        first = str(exc).splitlines()[-1] if str(exc) else "invalid request"
        return RedirectResponse(f"/jobs/{job_id}?profile_error={quote(first)}#profile",
                                status_code=303)
    return RedirectResponse(f"/jobs/{job_id}#profile", status_code=303)


@router.get("/jobs/{job_id}/profile.json")
def profile_runs_json(request: Request, job_id: str):
    """The job page polls this while a profile run is queued or running."""
    session = _session(request)
    return [{"id": r.id, "state": r.state, "error": r.error}
            for r in runs.list_runs(_db(request), session.tenant_id, job_id)]


@router.get("/jobs/{job_id}/artifact")
def artifact(request: Request, job_id: str):
    session = _session(request)
    db = _db(request)
    job, row = jobs.get(db, session.tenant_id, job_id)
    if row is None:
        raise APIError(409, "Conflict", f"job {job_id} has no artifact: it is {job.state}")
    model = models.get(db, session.tenant_id, job.model_id)
    return FileResponse(request.app.state.storage.resolve(row.path),
                        media_type="application/octet-stream",
                        filename=f"{Path(model.filename).stem or 'model'}.kiln")


# --- devices and profiles ------------------------------------------------------------------------

def _selector(text: str | None) -> tuple[sel.Selector, str | None]:
    try:
        return sel.parse(text), None
    except sel.SelectorError as exc:
        return sel.Selector(), str(exc)


@router.get("/devices")
def devices_page(request: Request, device: str | None = None):
    session = _session(request)
    selector, error = _selector(device)
    found = farm.list_devices(_db(request), selector) if error is None else []
    return render(request, "devices.html", session, devices=found, device=device or "",
                  error=error, keys=sel.TERMS)


@router.get("/devices/{device_id}")
def device_page(request: Request, device_id: str):
    session = _session(request)
    db = _db(request)
    device = farm.get_device(db, device_id)
    entries = library.list_entries(db, session.tenant_id, device=sel.parse(f"id:{device_id}"),
                                   op_type=None, job=None, source=None, signature=None,
                                   limit=PAGE_SIZE, offset=0)
    return render(request, "device.html", session, device=device, entries=entries)


def spread_plot(entries) -> list[dict[str, Any]]:
    """One row per entry of a signature: p10–p90 span and median, on a log scale of seconds."""
    if not entries:
        return []
    low = min(e.p10_s for e in entries)
    high = max(e.p90_s for e in entries)
    lo, hi = math.log10(low) - 0.1, math.log10(high) + 0.1

    def x(v: float) -> float:
        return 100 * (math.log10(v) - lo) / (hi - lo)

    return [{"entry": e, "label": ", ".join(e.devices) or e.device_fingerprint[:12],
             "x10": x(e.p10_s), "x50": x(e.median_s), "x90": x(e.p90_s)} for e in entries]


@router.get("/profiles")
def profiles_page(request: Request, device: str | None = None, op_type: str | None = None,
                  source: str | None = None, signature: str | None = None, job: str | None = None,
                  page: int = 0):
    session = _session(request)
    db = _db(request)
    selector, error = _selector(device)
    signature = (signature or "").strip().lower() or None
    if signature and not all(c in "0123456789abcdef" for c in signature):
        signature, error = None, "a signature is hexadecimal"
    found = plot = None
    if error is None:
        try:
            found = library.list_entries(
                db, session.tenant_id, device=selector, op_type=op_type or None,
                job=job or None, source=source if source in ("measured", "predicted") else None,
                signature=signature, limit=PAGE_SIZE, offset=max(page, 0) * PAGE_SIZE)
        except APIError as exc:
            error = exc.detail
    if signature and found and len(signature) == 64:
        plot = spread_plot(found.entries)
    summary = library.summary(db)
    top_day = max((n for _, n in summary.per_day), default=1)
    return render(request, "profiles.html", session, entries=found, summary=summary,
                  top_day=top_day, plot=plot, error=error, page=max(page, 0),
                  form={"device": device or "", "op_type": op_type or "", "source": source or "",
                        "signature": signature or "", "job": job or ""}, page_size=PAGE_SIZE)
