"""The ``ServiceClient`` routes: health, the client configuration the SDK asks for first,
registering an SDK client, its heartbeat and telemetry, the served model, and the key's clients.

Route and JSON names are the SDK's wire protocol, kept as it sends them: ``create_session``,
``session_id`` and ``/sessions`` name one SDK client."""

from fastapi import APIRouter, Request

from twinkle.server.checks import page
from twinkle.server.requests import body, new_id, server_of

router = APIRouter(prefix="/api/v1")

# what the SDK may do on its own; each is off, so it calls only the routes this server has
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.post("/client/config")
async def client_config(request: Request) -> dict:
    server_of(request).identify(request)
    await body(request)
    return CLIENT_CONFIG


@router.post("/client/dynamic_config")
async def dynamic_config(request: Request) -> dict:
    server_of(request).identify(request)
    await body(request)
    return {}


@router.post("/create_session")
async def register_client(request: Request) -> dict:
    s = server_of(request)
    tenant = s.auth(request)
    await body(request)
    client_id = new_id()
    s.registry.remember_client(tenant.id, client_id)
    return {"type": "create_session", "session_id": client_id}


@router.post("/session_heartbeat")
async def heartbeat(request: Request) -> dict:
    server_of(request).identify(request)
    await body(request)
    return {"type": "session_heartbeat"}


@router.post("/telemetry")
async def telemetry(request: Request) -> dict:
    server_of(request).identify(request)
    await body(request)
    return {"status": "accepted"}


@router.get("/get_server_capabilities")
async def capabilities(request: Request) -> dict:
    s = server_of(request)
    s.identify(request)
    model = {"model_name": s.base_model, "trainable": True, "sampleable": True}
    return {"supported_models": [model]}


@router.get("/sessions")
async def list_clients(request: Request) -> dict:
    s = server_of(request)
    tenant = s.auth(request)
    limit, offset = page(request.query_params, 20)
    mine = s.registry.clients_of(tenant.id)
    return {"sessions": mine[offset : offset + limit]}


@router.get("/sessions/{client_id}")
async def client_info(request: Request, client_id: str) -> dict:
    """The client's live training runs and the key's samplers."""
    s = server_of(request)
    tenant = s.auth(request)
    s.registry.check_client(tenant, client_id)
    runs = [r.id for r in s.registry.runs_of(tenant.id) if r.live]
    return {"training_run_ids": runs, "sampler_ids": s.registry.samplers_of(tenant.id)}


@router.post("/sessions/{client_id}/finish")
async def finish_client(request: Request, client_id: str) -> dict:
    """The SDK's ``ServiceClient.close()``: the client's runs and samplers stay usable."""
    s = server_of(request)
    tenant = s.identify(request)
    await body(request)
    s.registry.check_client(tenant, client_id)
    return {}
