"""The load figures' routes (``twinkle.server.metrics.ServerMetrics`` keeps them):

- ``GET /metrics``: Prometheus' text format, for the operator only: 404 unless the server was
  started with operator keys (``--operator-keys FILE`` or ``$TWINKLE_OPERATOR_KEYS``), 401
  without one of them (``Authorization: Bearer KEY``, as Prometheus' scrape config sends it, or
  ``X-API-Key: KEY``);
- ``GET /api/v1/usage``: a tenant's own figures (its key): requests waiting or running, its live
  and parked runs, its requests and tokens so far, and its limits."""

import hmac

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from twinkle.server.errors import NotFound, Unauthorized
from twinkle.server.requests import server_of

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    s = server_of(request)
    if not s.config.operator_keys:
        raise NotFound("/metrics is off: start the server with --operator-keys FILE to scrape it")
    auth = request.headers.get("authorization") or ""
    given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key") or ""
    found = False
    for key in s.config.operator_keys:  # every key compared, whichever matches
        found |= hmac.compare_digest(key.encode(), given.encode())
    if not found:
        raise Unauthorized("/metrics needs an operator key (Authorization: Bearer KEY)")
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(s.metrics.text(), media_type=CONTENT_TYPE_LATEST)


@router.get("/api/v1/usage")
async def usage(request: Request) -> JSONResponse:
    s = server_of(request)
    tenant = s.identify(request)
    mine = s.registry.runs_of(tenant.id)
    with s.metrics.lock:
        counts = dict(s.metrics.per_tenant.get(tenant.id, {}))
    return JSONResponse(
        {
            "queued": s.queue.depth(tenant=tenant.id),
            "runs": {
                "live": sum(r.live for r in mine),
                "parked": sum(not r.live and r.parked is not None for r in mine),
            },
            "requests": {lane: counts.get(f"{lane}_requests", 0) for lane in ("train", "sample")},
            "tokens": {kind: counts.get(f"tokens_{kind}", 0) for kind in ("trained", "sampled")},
            "limits": dict(tenant.limits.__dict__),
        }
    )
