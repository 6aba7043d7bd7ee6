"""What every route does with a request: find the app's ``Server`` (``server_of``), read the JSON
body (``body``), take one checked field of it (``field``), and answer a queued request with the
future the SDK polls (``future``, ``new_id``). The route modules (``twinkle.server.routes``)
import it; it imports none of them."""

import uuid
from typing import Any

from fastapi import Request

from twinkle.server.checks import IDS, Fields, check_float, check_id, check_int, load_json
from twinkle.server.errors import BadRequest
from twinkle.server.fields import FIELDS, check_fields
from twinkle.server.service import Server

PROTO = "application/x-protobuf"
MAX_JSON_BYTES = 64 << 20


def server_of(request: Request) -> Server:
    """The app's ``Server`` (``create_app`` sets ``app.state.server``). Each handler calls this
    itself rather than declaring a FastAPI dependency: FastAPI runs a plain-function dependency
    in its thread pool, a hop per request for one attribute read."""
    return request.app.state.server


async def body(request: Request) -> Fields:
    """The request's JSON object (``checks.load_json``: at most ``MAX_JSON_BYTES``, nested at most
    ``checks.MAX_DEPTH`` deep), its fields those its route takes (``fields.FIELDS``: any other
    is a 400 naming it)."""
    raw = await request.body()
    if len(raw) > MAX_JSON_BYTES:
        raise BadRequest(
            f"request body of {len(raw)} bytes is over the limit of {MAX_JSON_BYTES}", status=413
        )
    data = load_json(raw)
    route = request.scope["route"].path
    check_fields(data, FIELDS[route], route.removeprefix("/api/v1/"))
    return data


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
    """The answer to a queued request: the id the SDK polls at ``/api/v1/retrieve_future``."""
    return {"request_id": request_id, "model_id": model_id}


def new_id() -> str:
    """A fresh id for an SDK client, a sampler or a sampling adapter."""
    return uuid.uuid4().hex[:16]


__all__ = ["MAX_JSON_BYTES", "PROTO", "body", "field", "future", "new_id", "server_of"]
