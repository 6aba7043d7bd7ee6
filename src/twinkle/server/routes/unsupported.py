"""The Tinker SDK's routes this server does not implement: each answers 404 with a one-line
message naming the route, so a script learns at once what is missing.

Not 501: the SDK retries any 5xx answer for up to 5 minutes before raising it (its
``execute_with_retries``, which ``x-should-retry: false`` does not stop), while a 404 raises at
the first answer. The routes the SDK calls on its own (JWT exchange, joining another client's
sampler, ``retrieve_futures``, server-side custom losses) are turned off by the server's
``client/config``, so only a script's explicit call reaches one of these."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

V1 = "/api/v1"
CHECKPOINT = "/training_runs/{run_id}/checkpoints/{kind}/{name}"
# (methods, route, what it is)
ROUTES = [
    (["POST"], "/auth/token", "JWT exchange"),
    (["GET", "DELETE"], "/auth/apikey/me", "API key management"),
    (["GET"], "/audit", "audit log"),
    (["GET"], "/billing/usage/events", "billing"),
    (["GET"], "/billing/usage/checkpoints/current", "billing"),
    (["POST"], "/copy_weights", "copy_weights"),
    (["POST"], "/create_custom_loss", "server-side custom losses"),
    (["POST"], "/join_sampling_session", "joining another client's sampler"),
    (["POST"], "/retrieve_futures", "the batched futures poller"),
    (["POST"], "/save_weights_external", "save_weights_external"),
    (["POST"], "/sessions/search", "searching clients"),
    (["PUT"], "/sessions/{client_id}/project", "projects"),
    (["GET"], "/sessions/{client_id}/trace_export", "trace export"),
    (["GET"], CHECKPOINT + "/external_weights_urls", "external weights URLs"),
]
WHAT = {V1 + route: what for _, route, what in ROUTES}

router = APIRouter(prefix=V1)


async def not_implemented(request: Request) -> JSONResponse:
    """The answer of every route in ``ROUTES``, named by its path template."""
    route = request.scope["route"].path
    message = (
        f"{request.method} {route} ({WHAT[route]}) is not implemented by twinkle server; "
        "see 'Not supported' in docs/server.md"
    )
    return JSONResponse({"detail": message}, status_code=404, headers={"x-should-retry": "false"})


for _methods, _route, _ in ROUTES:
    router.add_api_route(_route, not_implemented, methods=_methods, include_in_schema=False)
