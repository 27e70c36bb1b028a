"""The API's documentation pages without the network. FastAPI's /docs and /redoc load Swagger UI and ReDoc from a
CDN: offline (as serving machines often are) they are blank pages. With the `docs` extra (fastapi-offline, which ships
both) they are served from this server; without it /docs is a page that links /openapi.json and names the extra."""

from __future__ import annotations

import html

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

EXTRA = "pip install 'hqtflow[docs]'"


def docs_app(**kwargs) -> FastAPI:
    """A FastAPI app (`kwargs` as FastAPI's) whose /docs and /redoc need no network."""
    try:
        from fastapi_offline import FastAPIOffline
    except ImportError:
        app = FastAPI(docs_url=None, redoc_url=None, **kwargs)
        app.get("/docs", include_in_schema=False)(_without_ui(app))
        return app
    return FastAPIOffline(**kwargs)  # Swagger UI and ReDoc from its package, under /static-offline-docs


def _without_ui(app: FastAPI):
    async def docs(request: Request) -> HTMLResponse:
        spec = html.escape(f"{request.scope.get('root_path', '')}{app.openapi_url}")
        title = html.escape(app.title)
        return HTMLResponse(
            f'<!doctype html><html><head><meta charset="utf-8"><title>{title}: API</title></head><body>'
            f'<h1>{title}</h1><p>The OpenAPI document of this server: <a href="{spec}">{spec}</a>.</p>'
            f"<p>Swagger UI and ReDoc are served here, without the network, once the docs extra is installed: "
            f"<code>{html.escape(EXTRA)}</code> (fastapi-offline), then restart the server.</p></body></html>")
    return docs
