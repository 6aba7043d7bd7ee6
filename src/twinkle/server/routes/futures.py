"""The futures of queued requests: ``retrieve_future`` (the SDK's poll: the answer, or
``try_again`` after about 2 s) and ``cancel_future``. Polling is keyed but takes nothing from
the key's rate bucket (``Server.identify``)."""

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from twinkle.server.checks import for_client
from twinkle.server.requests import PROTO, body, field, server_of

router = APIRouter(prefix="/api/v1")
POLL_SECONDS = 2.0  # how long one poll waits for the answer before it says try_again


@router.post("/retrieve_future")
async def retrieve_future(request: Request) -> Any:
    s = server_of(request)
    tenant = s.identify(request)
    data = await body(request)
    fut = s.queue.future(tenant.id, field(data, "request_id", str))
    if not fut.done.is_set():
        loop, answered = asyncio.get_running_loop(), asyncio.Event()
        forget = fut.on_done(lambda: loop.call_soon_threadsafe(answered.set))
        try:
            await asyncio.wait_for(answered.wait(), POLL_SECONDS)
        except TimeoutError:
            pass
        finally:
            forget()
    if not fut.done.is_set():
        return JSONResponse(
            {"type": "try_again", "request_id": data["request_id"], "queue_state": "active"}, 408
        )
    s.queue.retrieved(fut)
    if fut.error is not None:
        message, category = fut.error
        error = for_client(message, s.config.output_dir)
        return {"error": error, "category": "user" if category == "user" else "server"}
    if isinstance(fut.result, bytes):
        return Response(fut.result, media_type=PROTO)
    return fut.result


@router.post("/cancel_future")
async def cancel_future(request: Request) -> dict:
    s = server_of(request)
    tenant = s.identify(request)
    s.queue.cancel(tenant.id, field(await body(request), "request_id", str, required=True))
    return {}
