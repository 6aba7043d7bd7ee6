"""The FastAPI app: the Tinker SDK's routes (``/api/v1/...``) over one ``Engine`` (the model in
this process, or on Ray device groups with ``--mode ray``).

Requests are authenticated by the ``X-API-Key`` header (compared in constant time with every
configured key). Work on the model goes through the ``Queue`` and answers with a future the
SDK polls at ``/api/v1/retrieve_future``; everything else answers at once. A malformed request
is a 4xx with ``{"detail": "<one line>"}``; a failure inside a queued step fails that request
only (its future holds the error)."""

import asyncio
import contextlib
import hmac
import logging
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from twinkle.server.checks import (
    IDS,
    Fields,
    check_float,
    check_id,
    check_int,
    for_client,
    load_json,
    one_line,
)
from twinkle.server.config import ServerConfig
from twinkle.server.engine import Engine, build_engine
from twinkle.server.errors import BadRequest, NotFound, ServerError, TooMany, Unauthorized
from twinkle.server.queue import Queue
from twinkle.server.state import Registry, Tenant, check_output_dir, tenant_id

log = logging.getLogger("twinkle.server")
PROTO = "application/x-protobuf"
NO_RETRY = {"x-should-retry": "false"}
MAX_JSON_BYTES = 64 << 20


class Server:
    """The app's state: config, engine, tenants, their runs, the SDK clients' ids and the samplers, and
    the queue."""

    def __init__(self, config: ServerConfig, engine: Engine | None = None):
        from twinkle.server.metrics import ServerMetrics

        self.config = config
        check_output_dir(config.output_dir)  # one error line before the model is built
        self.queue = Queue(
            max_seconds=config.max_request_seconds,
            future_ttl=config.future_ttl,
            max_queued=config.max_queued,
            # a paused sample holds an adapter slot: half of them at most, the rest for training
            max_started=max(1, config.max_loras // 2),
            on_done=lambda *a: self.metrics.done(*a),
        )
        if engine is None and config.mode == "local":  # the model computes on the queue's worker only
            engine = self.queue.call(lambda: build_engine(config))
        self.engine = engine or build_engine(config)  # --mode ray: Ray starts on the main thread
        self.base_model = config.model_id or "bundled:SmolLM2-135M-Instruct"
        self.tenants = {key: Tenant(tenant_id(key), limits) for key, limits in config.keys.items()}
        for t in self.tenants.values():
            t.tokens = t.limits.rate * 4
        config.output_dir.mkdir(parents=True, exist_ok=True)
        self.reporter = None
        if config.report_to:
            from twinkle.server.report import Reporter

            self.reporter = Reporter(config.report_to, config.output_dir)
        self.registry = Registry(config.output_dir, self.reporter)
        self.clients = self.registry.clients  # an SDK client's id (its session_id) -> tenant id
        self.samplers = self.registry.samplers  # sampler id -> (tenant, checkpoint path or None)
        self.metrics = ServerMetrics(self)
        if config.idle_timeout > 0:
            threading.Thread(target=self._sweep, name="twinkle-server-idle", daemon=True).start()

    # ---------------------------------------------------------------- runs on the model
    def on_run(self, tenant: Tenant, run: Any, fn: Any) -> str:
        """Queue ``fn`` for the run; a parked run (idle, or from before a restart) is first loaded
        back into a slot."""

        def job() -> Any:
            if not run.live and run.parked is not None and not Path(run.parked).is_dir():
                # its save was deleted (by the tenant, or a TTL): the newest one left, if any
                run.parked, run.parked_optimizer = self.registry.restore_point(run)
                if run.parked is None:
                    raise NotFound(f"training run {run.id!r} has no saved state left to resume from")
            if not run.live and run.parked is not None:
                self.make_room(keep=run)
                self.engine.add(run.adapter, run.rank)
                try:
                    self.engine.load(run.adapter, Path(run.parked), optimizer=run.parked_optimizer)
                except Exception:
                    self.engine.remove(run.adapter)
                    raise
                run.live, run.parked, run.parked_optimizer = True, None, True
            return fn()

        return self.queue.submit(tenant.id, job)

    def make_room(self, keep: Any = None) -> None:
        """A free adapter slot (in the worker): when every slot is taken, the live run whose last
        request is the oldest (not ``keep``) is parked; its next request loads it back."""
        if self.engine.free_slots():
            return
        live = [r for r in self.registry.runs_of() if r.live and r is not keep]
        if not live:
            raise ServerError(
                f"every adapter slot (--max-loras {self.config.max_loras}) is in use and none can be "
                "freed; retry shortly, or start the server with a higher --max-loras",
                status=503,
                retry_after=1.0,
            )
        self.park(min(live, key=lambda r: r.last_request), force=True)

    def park(self, run: Any, force: bool = False) -> None:
        """Save a run idle for ``--idle-timeout`` (or any live run, ``force``) as
        ``weights/parked-<ms>`` (adapter, AdamW state and any gradients of an open window), free
        its slot, and delete the run's older ``parked-`` saves."""
        idle = time.time() - run.last_request >= self.config.idle_timeout
        if not run.live or not (force or idle):
            return
        weights = self.registry.folder(run) / "weights"
        older = list(weights.glob("parked-*"))
        folder = weights / f"parked-{int(time.time() * 1000)}"
        self.engine.save(run.adapter, folder, optimizer=True)
        self.engine.remove(run.adapter)
        run.live, run.parked, run.parked_optimizer = False, str(folder), True
        for old in older:
            shutil.rmtree(old, ignore_errors=True)

    def _sweep(self) -> None:
        period = min(max(self.config.idle_timeout / 4, 0.05), 30.0)
        while not self.queue.stopped:
            time.sleep(period)
            now = time.time()
            for run in self.registry.runs_of():
                if run.live and now - run.last_request >= self.config.idle_timeout:
                    with contextlib.suppress(TooMany):  # its tenant's line is full: parked next time
                        self.queue.submit(run.tenant, lambda run=run: self.park(run))

    def auth(self, request: Request) -> Tenant:
        """The caller's tenant, one request taken from its rate bucket."""
        tenant = self.identify(request)
        tenant.take()
        return tenant

    def identify(self, request: Request) -> Tenant:
        """The caller's tenant (polling a future takes nothing from the rate bucket)."""
        given = request.headers.get("x-api-key") or ""
        found = None
        for key, tenant in self.tenants.items():  # every key compared, whichever matches
            if hmac.compare_digest(key.encode(), given.encode()):
                found = tenant
        if found is None:
            raise Unauthorized(
                "missing or unknown API key; send a key the server was started with as X-API-Key"
            )
        return found


async def body(request: Request) -> Fields:
    """The request's JSON object (``checks.load_json``: at most ``MAX_JSON_BYTES``, nested at most
    ``checks.MAX_DEPTH`` deep)."""
    raw = await request.body()
    if len(raw) > MAX_JSON_BYTES:
        raise BadRequest(
            f"request body of {len(raw)} bytes is over the limit of {MAX_JSON_BYTES}", status=413
        )
    return load_json(raw)


def field(data: dict, name: str, kind: type | tuple, default: Any = ..., required: bool = False) -> Any:
    """``data[name]`` checked to be of ``kind`` (a missing one is ``default``); a refusal names
    the field by its path in the body (``sampling_params.seed``). An integer must fit int64 (or
    the field's range in ``checks.RANGES``), a number be finite, a string named in
    ``checks.IDS`` be an id (``checks.check_id``); an object comes back as ``checks.Fields``."""
    where = data.path(name) if isinstance(data, Fields) else name
    if name not in data or data[name] is None:
        if required or default is ...:
            raise BadRequest(f"field {where!r} is missing")
        return Fields(default, where) if isinstance(default, dict) else default
    value = data[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise BadRequest(f"field {where!r} must be {names}, got {type(value).__name__}")
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and float not in kinds:
        return check_int(value, where)
    if isinstance(value, int | float):  # a number: an integer too large for a float is not finite
        return check_float(value, where)
    if isinstance(value, str) and name in IDS:
        return check_id(value, f"field {where!r}")
    if isinstance(value, dict) and not isinstance(value, Fields):
        return Fields(value, where)
    return value


def future(request_id: str, model_id: str | None = None) -> dict[str, Any]:
    return {"request_id": request_id, "model_id": model_id}


def create_app(config: ServerConfig, engine: Engine | None = None) -> FastAPI:
    from twinkle.server import routes
    from twinkle.server.metrics import add_metrics_routes

    server = Server(config, engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        yield
        if server.reporter is not None:  # the libraries' last records reach their files
            server.reporter.close()

    app = FastAPI(title="twinkle server", lifespan=lifespan)
    app.state.server = server

    root = config.output_dir

    @app.exception_handler(ServerError)
    async def _refused(request: Request, exc: ServerError) -> JSONResponse:
        detail = for_client(exc.message, root)
        return JSONResponse({"detail": detail}, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = (exc.errors() or [{}])[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "the request"
        detail = one_line(f"{where}: {first.get('msg', 'invalid')}", 500)
        return JSONResponse({"detail": detail}, status_code=400, headers=NO_RETRY)

    @app.exception_handler(HTTPException)
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

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # one line here: the server (uvicorn) logs the traceback when the exception comes back up
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        detail = f"internal error: {type(exc).__name__}"
        return JSONResponse({"detail": detail}, status_code=500, headers=NO_RETRY)

    routes.add_routes(app, server)
    add_metrics_routes(app, server)

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Any:
        tenant = server.identify(request)
        data = await body(request)
        fut = server.queue.future(tenant.id, field(data, "request_id", str))
        deadline = time.monotonic() + 2.0
        while not fut.done.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if not fut.done.is_set():
            return JSONResponse(
                {"type": "try_again", "request_id": data["request_id"], "queue_state": "active"}, 408
            )
        server.queue.retrieved(fut)
        if fut.error is not None:
            message, category = fut.error
            error = for_client(message, root)
            return {"error": error, "category": "user" if category == "user" else "server"}
        if isinstance(fut.result, bytes):
            return Response(fut.result, media_type=PROTO)
        return fut.result

    return app


def new_id() -> str:
    return uuid.uuid4().hex[:16]


__all__ = ["PROTO", "Server", "create_app", "body", "field", "future", "new_id"]
