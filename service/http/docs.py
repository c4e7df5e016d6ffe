"""/docs (Swagger UI) and /redoc from the assets that the `fastapi-offline` package ships, so the
pages work on a machine without internet (FastAPI's defaults load them from a CDN)."""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse

ASSETS = Path(fastapi_offline.__file__).parent / "static"
STATIC = "/static/docs"


def mount_docs(app: FastAPI) -> None:
    app.mount(STATIC, StaticFiles(directory=ASSETS), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - API",
            swagger_js_url=f"{root}{STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{root}{STATIC}/favicon.png",
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - API reference",
            redoc_js_url=f"{root}{STATIC}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{STATIC}/favicon.png",
            with_google_fonts=False,
        )
