"""``create_app``: the FastAPI app of a ``ServerConfig``: its state (``twinkle.server.service.Server``:
the model, the queue, the tenants and the registry), the answer to every error, and the routes
(``twinkle.server.routes``).

Requests are authenticated by the ``X-API-Key`` header (``Server.auth``). Work on the model goes
through the ``Queue`` and answers with a future the SDK polls at ``/api/v1/retrieve_future``;
everything else answers at once. A malformed request is a 4xx with ``{"detail": "<one line>"}``;
a failure inside a queued step fails that request only (its future holds the error)."""

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from twinkle.server.checks import for_client, one_line
from twinkle.server.config import ServerConfig
from twinkle.server.engine import Engine
from twinkle.server.errors import ServerError
from twinkle.server.routes import ROUTERS
from twinkle.server.service import Server

log = logging.getLogger("twinkle.server")
NO_RETRY = {"x-should-retry": "false"}


def create_app(config: ServerConfig, engine: Engine | None = None) -> FastAPI:
    """The app serving ``config`` (its model built now unless ``engine`` is given)."""
    server = Server(config, engine)
    app = FastAPI(title="twinkle server", lifespan=_lifespan)
    app.state.server = server
    app.add_exception_handler(ServerError, _refused)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http)
    app.add_exception_handler(Exception, _internal)
    # each family's routes are added to the app itself, not included as routers: FastAPI matches
    # an included router by walking its route list again on every request, a cost per request
    # (twice the routing of a flat list for an unknown path) for the same answers
    for router in ROUTERS:
        for route in router.routes:
            app.add_api_route(
                route.path,
                route.endpoint,
                methods=route.methods,
                include_in_schema=route.include_in_schema,
                name=route.name,
            )
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    server = app.state.server
    if server.reporter is not None:  # the libraries' last records reach their files
        server.reporter.close()


async def _refused(request: Request, exc: ServerError) -> JSONResponse:
    detail = for_client(exc.message, request.app.state.server.config.output_dir)
    return JSONResponse({"detail": detail}, status_code=exc.status, headers=exc.headers)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = (exc.errors() or [{}])[0]
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "the request"
    detail = one_line(f"{where}: {first.get('msg', 'invalid')}", 500)
    return JSONResponse({"detail": detail}, status_code=400, headers=NO_RETRY)


async def _http(request: Request, exc: HTTPException) -> JSONResponse:
    route = f"{request.method} {one_line(request.url.path, 200)}"
    if exc.status_code == 404:
        detail = f"{route} is not a route of twinkle server (the Tinker API is under /api/v1)"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        detail = f"{route}: method not allowed" + (f" (allowed: {allowed})" if allowed else "")
    else:
        detail = f"{route}: {one_line(str(exc.detail), 500)}"
    headers = {**(exc.headers or {}), **NO_RETRY}
    return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=headers)


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    # one line here: the server (uvicorn) logs the traceback when the exception comes back up
    log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    detail = f"internal error: {type(exc).__name__}"
    return JSONResponse({"detail": detail}, status_code=500, headers=NO_RETRY)


__all__ = ["create_app"]
