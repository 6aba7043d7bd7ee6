"""The ``RestClient`` routes: a tenant's training runs and checkpoints (listing, info, delete,
TTLs). Another tenant's run or checkpoint is a 404, as an unknown one."""

from typing import Any

from fastapi import FastAPI, Request

from twinkle.server.app import Server, body, field
from twinkle.server.checks import page as page_of
from twinkle.server.errors import NotFound
from twinkle.server.runs import check_ttl


def add_rest_routes(app: FastAPI, s: Server, iso: Any) -> None:
    v1 = "/api/v1"

    def checkpoint_json(c: dict) -> dict:
        return {**c, "time": iso(c["time"]), "expires_at": iso(c["expires_at"]) if c["expires_at"] else None}

    def run_json(run: Any) -> dict:
        ckpts = s.registry.checkpoints(run)
        last = {t: checkpoint_json(c) for c in ckpts for t in [c["checkpoint_type"]]}
        return {
            "training_run_id": run.id,
            "base_model": run.base_model,
            "model_owner": run.tenant,
            "is_lora": True,
            "lora_rank": run.rank,
            "last_request_time": iso(run.last_request),
            "last_checkpoint": last.get("training"),
            "last_sampler_checkpoint": last.get("sampler"),
        }

    @app.get(f"{v1}/training_runs")
    async def training_runs(request: Request) -> dict:
        tenant = s.auth(request)
        limit, offset = page_of(request.query_params, 20)
        mine = sorted(s.registry.runs_of(tenant.id), key=lambda r: r.created)
        page = mine[offset : offset + limit]
        return {
            "training_runs": [run_json(r) for r in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(mine)},
        }

    @app.get(f"{v1}/training_runs/{{run_id}}")
    async def training_run(request: Request, run_id: str) -> dict:
        return run_json(s.registry.run_of(s.auth(request), run_id, live=False))

    @app.get(f"{v1}/training_runs/{{run_id}}/checkpoints")
    async def checkpoints(request: Request, run_id: str) -> dict:
        run = s.registry.run_of(s.auth(request), run_id, live=False)
        return {"checkpoints": [checkpoint_json(c) for c in s.registry.checkpoints(run)]}

    @app.delete(f"{v1}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}")
    async def delete_checkpoint(request: Request, run_id: str, kind: str, name: str) -> dict:
        run, _, _ = s.registry.checkpoint(s.auth(request), f"tinker://{run_id}/{kind}/{name}")
        s.registry.forget(run, f"{kind}/{name}")
        return {}

    @app.put(f"{v1}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/ttl")
    async def set_ttl(request: Request, run_id: str, kind: str, name: str) -> dict:
        run, _, _ = s.registry.checkpoint(s.auth(request), f"tinker://{run_id}/{kind}/{name}")
        ttl = check_ttl(field(await body(request), "ttl_seconds", int, default=None))
        s.registry.set_ttl(run, f"{kind}/{name}", ttl)
        return {}

    @app.get(f"{v1}/checkpoints")
    async def all_checkpoints(request: Request) -> dict:
        tenant = s.auth(request)
        limit, offset = page_of(request.query_params, 100)
        out = [checkpoint_json(c) for r in s.registry.runs_of(tenant.id) for c in s.registry.checkpoints(r)]
        out.sort(key=lambda c: c["time"], reverse=True)
        page = out[offset : offset + limit]
        return {"checkpoints": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(out)}}

    @app.post(f"{v1}/weights_info")
    async def weights_info(request: Request) -> dict:
        tenant = s.auth(request)
        path = field(await body(request), "tinker_path", str, required=True)
        run, _, _ = s.registry.checkpoint(tenant, path)
        return {"base_model": run.base_model, "is_lora": True, "lora_rank": run.rank}

    @app.get(f"{v1}/sessions/{{client_id}}")  # the SDK's wire name: one SDK client
    async def client_info(request: Request, client_id: str) -> dict:
        tenant = s.auth(request)
        if s.clients.get(client_id) != tenant.id:
            raise NotFound(f"client {client_id!r} is not one of this key's")
        runs = [r.id for r in s.registry.runs_of(tenant.id) if r.live]
        return {"training_run_ids": runs, "sampler_ids": s.registry.samplers_of(tenant.id)}

    @app.get(f"{v1}/samplers/{{sampler_id}}")
    async def sampler(request: Request, sampler_id: str) -> dict:
        tenant = s.auth(request)
        owner, path = s.samplers.get(sampler_id, (None, None))
        if owner != tenant.id:
            raise NotFound(f"sampler {sampler_id!r} is not one of this key's")
        return {"sampler_id": sampler_id, "base_model": s.base_model, "model_path": path}
