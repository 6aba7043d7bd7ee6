"""The Tinker routes: client registration and configuration, training runs and their checkpoints (sampling
is ``twinkle.server.sampling``, the REST listing ``twinkle.server.rest``). Model work is queued
(``Server.queue``) and answered with a future.

Route and JSON names are the SDK's wire protocol, kept as it sends them: ``create_session``,
``session_id`` and ``/sessions`` name one SDK client."""

import time
from datetime import UTC, datetime

from fastapi import FastAPI, Request

from twinkle.server.app import PROTO, Server, body, field, future, new_id
from twinkle.server.checks import page
from twinkle.server.errors import BadRequest, NotFound
from twinkle.server.runs import check_base, open_run, save, save_options, start_run
from twinkle.server.wire import (
    decode_forward_backward,
    encode_forward_backward_output,
)

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


def add_routes(app: FastAPI, s: Server) -> None:
    v1 = "/api/v1"

    @app.get(f"{v1}/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.post(f"{v1}/client/config")
    async def client_config(request: Request) -> dict:
        s.identify(request)
        return CLIENT_CONFIG

    @app.post(f"{v1}/client/dynamic_config")
    async def dynamic_config(request: Request) -> dict:
        s.identify(request)
        return {}

    @app.post(f"{v1}/create_session")
    async def register_client(request: Request) -> dict:
        tenant = s.auth(request)
        await body(request)
        client_id = new_id()
        s.registry.remember_client(tenant.id, client_id)
        return {"type": "create_session", "session_id": client_id}

    @app.post(f"{v1}/session_heartbeat")
    async def heartbeat(request: Request) -> dict:
        s.identify(request)
        return {"type": "session_heartbeat"}

    @app.post(f"{v1}/telemetry")
    async def telemetry(request: Request) -> dict:
        s.identify(request)
        return {"status": "accepted"}

    @app.get(f"{v1}/get_server_capabilities")
    async def capabilities(request: Request) -> dict:
        s.identify(request)
        model = {"model_name": s.base_model, "trainable": True, "sampleable": True}
        return {"supported_models": [model]}

    @app.post(f"{v1}/create_model")
    async def create_model(request: Request) -> dict:
        tenant = s.auth(request)
        data = await body(request)
        base = check_base(s, data)
        lora = field(data, "lora_config", dict, default={"rank": 32})
        rank = open_run(s, tenant, field(lora, "rank", int, required=True))
        seed = field(lora, "seed", int, default=0)
        rid = s.queue.submit(
            tenant.id, lambda: {"model_id": start_run(s, tenant, base, rank, seed).id, "type": "create_model"}
        )
        return future(rid)

    @app.post(f"{v1}/get_info")
    async def get_info(request: Request) -> dict:
        tenant = s.auth(request)
        data = await body(request)
        run = s.registry.run_of(tenant, field(data, "model_id", str), live=False)
        return {
            "type": "get_info",
            "model_data": {"arch": "lora", "model_name": run.base_model, "tokenizer_id": run.base_model},
            "model_id": run.id,
            "is_lora": True,
            "lora_rank": run.rank,
        }

    @app.post(f"{v1}/unload_model")
    async def unload_model(request: Request) -> dict:
        tenant = s.auth(request)
        run = s.registry.run_of(tenant, field(await body(request), "model_id", str))

        def unload() -> dict:
            s.engine.remove(run.adapter)
            run.live, run.parked = False, None
            return {"model_id": run.id, "type": "unload_model"}

        return future(s.on_run(tenant, run, unload), run.id)

    @app.post(f"{v1}/forward_backward")
    async def forward_backward(request: Request) -> dict:
        tenant = s.auth(request)
        if PROTO not in request.headers.get("content-type", ""):
            raise BadRequest(
                f"forward_backward takes a protobuf body (Content-Type: {PROTO}), as the Tinker SDK sends"
            )
        req = decode_forward_backward(
            await request.body(), tenant.limits.max_datums, tenant.limits.max_tokens
        )
        run = s.registry.run_of(tenant, req.model_id)

        def step() -> bytes:
            start = time.perf_counter()
            outs, metrics = s.engine.forward_backward(
                run.adapter, req.data, req.loss_fn, req.loss_config, req.forward_only
            )
            tokens = sum(d.tokens.size for d in req.data)
            s.metrics.counted(tenant.id, "trained", tokens)
            seconds = round(time.perf_counter() - start, 4)
            op = "forward" if req.forward_only else "forward_backward"
            s.registry.log(
                run, {"op": op, "datums": len(req.data), "tokens": tokens, "seconds": seconds, **metrics}
            )
            return encode_forward_backward_output(outs, metrics)

        return future(s.on_run(tenant, run, step), run.id)

    @app.post(f"{v1}/optim_step")
    async def optim_step(request: Request) -> dict:
        tenant = s.auth(request)
        data = await body(request)
        run = s.registry.run_of(tenant, field(data, "model_id", str))
        adam = field(data, "adam_params", dict, default=None) or field(data, "optim_params", dict, default={})
        for k in adam:
            if k != "type":
                field(adam, k, (int, float))

        def step() -> dict:
            metrics = s.engine.optim_step(run.adapter, adam)
            s.registry.log(run, {"op": "optim_step", "lr": adam.get("learning_rate"), **metrics})
            return {"metrics": metrics}

        return future(s.on_run(tenant, run, step), run.id)

    @app.post(f"{v1}/save_weights")
    async def save_weights(request: Request) -> dict:
        tenant = s.auth(request)
        data = await body(request)
        run = s.registry.run_of(tenant, field(data, "model_id", str))
        opts = save_options(data)
        rid = s.on_run(
            tenant, run, lambda: {"path": save(s, run, "weights", True, **opts), "type": "save_weights"}
        )
        return future(rid, run.id)

    @app.post(f"{v1}/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict:
        tenant = s.auth(request)
        data = await body(request)
        run = s.registry.run_of(tenant, field(data, "model_id", str))
        opts = save_options(data)

        def job() -> dict:
            path = save(s, run, "sampler_weights", False, **opts)
            sampler_id = None
            if opts["name"] is None:  # save_weights_and_get_sampling_client: a sampler on it
                sampler_id = new_id()
                s.registry.remember_sampler(tenant.id, sampler_id, path)
            return {"path": path, "sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

        return future(s.on_run(tenant, run, job), run.id)

    @app.post(f"{v1}/load_weights")
    async def load_weights(request: Request) -> dict:
        tenant = s.auth(request)
        data = await body(request)
        src, kind, folder = s.registry.checkpoint(tenant, field(data, "path", str, required=True))
        optimizer = field(data, "optimizer", bool, default=False)
        model_id = field(data, "model_id", str, default=None)
        run = s.registry.run_of(tenant, model_id) if model_id else None
        new_id_ = None
        if run is None:  # a new training client from the checkpoint: the SDK names it
            check_base(s, data)
            open_run(s, tenant, src.rank)
            client_id = field(data, "session_id", str, required=True)
            if s.clients.get(client_id) != tenant.id:
                raise NotFound(f"client {client_id!r} is not one of this key's")
            new_id_ = f"{client_id}:train:{field(data, 'model_seq_id', int, required=True)}"
            if new_id_ in s.registry.runs:
                raise BadRequest(f"model {new_id_!r} exists already; use a new model_seq_id")

        def job() -> dict:
            target = run or start_run(s, tenant, src.base_model, src.rank, run_id=new_id_)
            s.engine.load(target.adapter, folder, optimizer and kind == "weights")
            return {"path": data["path"], "model_id": target.id, "type": "load_weights"}

        return future(s.on_run(tenant, run, job) if run else s.queue.submit(tenant.id, job), model_id)

    @app.post(f"{v1}/cancel_future")
    async def cancel_future(request: Request) -> dict:
        tenant = s.identify(request)
        s.queue.cancel(tenant.id, field(await body(request), "request_id", str, required=True))
        return {}

    @app.get(f"{v1}/sessions")  # the SDK's wire names: its clients (module docstring)
    async def list_clients(request: Request) -> dict:
        tenant = s.auth(request)
        limit, offset = page(request.query_params, 20)
        mine = s.registry.clients_of(tenant.id)
        return {"sessions": mine[offset : offset + limit]}

    @app.post(f"{v1}/sessions/{{client_id}}/finish")
    async def finish_client(request: Request, client_id: str) -> dict:
        """The SDK's ``ServiceClient.close()``: the client's runs and samplers stay usable."""
        tenant = s.identify(request)
        if s.clients.get(client_id) != tenant.id:
            raise NotFound(f"client {client_id!r} is not one of this key's")
        return {}

    from twinkle.server.rest import add_rest_routes
    from twinkle.server.sampling import add_sampling_routes
    from twinkle.server.unsupported import add_unsupported_routes

    add_sampling_routes(app, s)
    add_rest_routes(app, s, _iso)
    add_unsupported_routes(app)
