"""The FastAPI application: `create_app()` (uvicorn --factory service.app:create_app)."""
from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel

from service import problems
from service.db import database
from service.dispatch import Dispatcher
from service.settings import Settings
from service.storage import Storage

API_VERSION = "1.0.0"

DESCRIPTION = """Kiln compiles ONNX models into fused native kernels.

1. `POST /v1/models` with the ONNX file as the body → a model id (the same bytes are stored once).
2. `POST /v1/jobs` with the model id, a target and a partitioner → 202 and a job.
3. Follow `GET /v1/jobs/{id}/events` (server-sent events) or poll `GET /v1/jobs/{id}`.
4. `GET /v1/jobs/{id}/artifact` and `/report` once it has succeeded.

Every request needs an API key (`Authorization: Bearer <key>`); a tenant sees only its own models
and jobs. Errors are `application/problem+json` whose `detail` says what was wrong.
"""


class Health(BaseModel):
    status: str
    version: str
    database: str
    broker: str


def create_app(settings: Settings | None = None) -> FastAPI:
    from workers.protocol import broker_app

    settings = settings or Settings()
    app = FastAPI(title="Kiln compilation service", version=API_VERSION, description=DESCRIPTION,
                  openapi_url="/v1/openapi.json", docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.db = database(settings.database_url)
    app.state.storage = Storage(settings.storage_root)
    app.state.dispatcher = Dispatcher(broker_app(settings))
    problems.install(app)

    from service.devices.router import install_body_limit
    from service.devices.router import router as agents_router
    from service.jobs.router import router as jobs_router
    from service.models.router import router as models_router

    app.include_router(models_router)
    app.include_router(jobs_router)
    app.include_router(agents_router)
    from service.devices.farm_router import router as devices_router
    from service.profiles.router import router as profiles_router

    app.include_router(devices_router)
    app.include_router(profiles_router)
    from service.dashboard import docs
    from service.dashboard import router as dashboard

    docs.install(app)
    dashboard.install(app)
    install_body_limit(app)

    @app.get("/v1/health", response_model=Health, tags=["service"], summary="Liveness")
    def health() -> Health:
        return Health(status="ok", version=API_VERSION, database=app.state.db.dialect,
                      broker=settings.broker_url.split("://")[0])

    return app
