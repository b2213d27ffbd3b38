"""`/v1/docs`: Swagger UI served from Kiln itself, so the API documentation works without internet
access. The files are those the fastapi-offline package ships (Swagger UI 5, which reads the
OpenAPI 3.1 that FastAPI writes); only its static folder is used."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.staticfiles import StaticFiles

ASSETS = "/static/swagger-ui"


def install(app: FastAPI) -> None:
    import fastapi_offline

    folder = Path(fastapi_offline.__file__).parent / "static"
    app.mount(ASSETS, StaticFiles(directory=folder), name="swagger-ui")

    @app.get("/v1/docs", include_in_schema=False)
    def docs():
        return get_swagger_ui_html(
            openapi_url=app.openapi_url, title=f"{app.title} – API",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon.png")
