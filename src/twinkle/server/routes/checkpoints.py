"""The checkpoint routes: a run's saves (``save_weights``, ``save_weights_for_sampler``) and loads
(``load_weights``, into the run or into a new one), and the ``RestClient``'s checkpoints of the
key (listing, delete, TTL, ``weights_info``). Another tenant's run or checkpoint is a 404, as an
unknown one."""

import shutil
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request

from twinkle.server.checks import check_name, page
from twinkle.server.errors import BadRequest
from twinkle.server.requests import body, field, future, new_id, server_of
from twinkle.server.runs import SAVE_DIR, check_base, checkpoint_json, open_run, start_run
from twinkle.server.service import Server
from twinkle.server.state import Run

router = APIRouter(prefix="/api/v1")
MAX_TTL = 10 * 365 * 24 * 3600


@router.post("/save_weights")
async def save_weights(request: Request) -> dict:
    s = server_of(request)
    tenant = s.auth(request)
    data = await body(request)
    run = s.registry.run_of(tenant, field(data, "model_id", str))
    opts = save_options(data)
    rid = s.on_run(
        tenant, run, lambda: {"path": save(s, run, "weights", True, **opts), "type": "save_weights"}
    )
    return future(rid, run.id)


@router.post("/save_weights_for_sampler")
async def save_for_sampler(request: Request) -> dict:
    s = server_of(request)
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


@router.post("/load_weights")
async def load_weights(request: Request) -> dict:
    s = server_of(request)
    tenant = s.auth(request)
    data = await body(request)
    src, kind, folder = s.registry.checkpoint(tenant, field(data, "path", str, required=True), read=True)
    optimizer = field(data, "optimizer", bool, default=False)
    model_id = field(data, "model_id", str, default=None)
    run = s.registry.run_of(tenant, model_id) if model_id else None
    meta = field(data, "user_metadata", dict, default=None)
    if run is not None and meta is not None:
        raise BadRequest("user_metadata labels a new training run; this load goes into an existing one")
    new_run_id = None
    if run is None:  # a new training client from the checkpoint: the SDK names it
        check_base(s, data)
        open_run(s, tenant, src.rank)
        client_id = field(data, "session_id", str, required=True)
        s.registry.check_client(tenant, client_id)
        new_run_id = f"{client_id}:train:{field(data, 'model_seq_id', int, required=True)}"
        if new_run_id in s.registry.runs:
            raise BadRequest(f"model {new_run_id!r} exists already; use a new model_seq_id")

    def job() -> dict:
        target = run or start_run(s, tenant, src.base_model, src.rank, run_id=new_run_id, user_metadata=meta)
        s.engine.core.load(target.adapter, folder, optimizer and kind == "weights")
        return {"path": data["path"], "model_id": target.id, "type": "load_weights"}

    return future(s.on_run(tenant, run, job) if run else s.queue.submit(tenant.id, job), model_id)


@router.get("/training_runs/{run_id}/checkpoints")
async def checkpoints(request: Request, run_id: str) -> dict:
    s = server_of(request)
    run = s.registry.run_of(s.auth(request), run_id, live=False)
    return {"checkpoints": [checkpoint_json(c) for c in s.registry.checkpoints(run)]}


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}")
async def delete_checkpoint(request: Request, run_id: str, kind: str, name: str) -> dict:
    s = server_of(request)
    run, _, _ = s.registry.checkpoint(s.auth(request), f"tinker://{run_id}/{kind}/{name}")
    s.registry.forget(run, f"{kind}/{name}")
    return {}


@router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
async def set_ttl(request: Request, run_id: str, kind: str, name: str) -> dict:
    s = server_of(request)
    tenant = s.auth(request)
    data = await body(request)
    run, _, _ = s.registry.checkpoint(tenant, f"tinker://{run_id}/{kind}/{name}")
    ttl = check_ttl(field(data, "ttl_seconds", int, default=None))
    s.registry.set_ttl(run, f"{kind}/{name}", ttl)
    return {}


@router.post("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
async def publish(request: Request, run_id: str, kind: str, name: str) -> dict:
    """Tinker's publishing: every key of this server may then load the checkpoint, sample from
    it and read its ``weights_info`` by its path (its owner alone deletes it or sets its TTL).
    Nothing leaves the server: upstream's upload to a model hub is ``twinkle export`` and the
    hub's own client."""
    s = server_of(request)
    run, _, _ = s.registry.checkpoint(s.auth(request), f"tinker://{run_id}/{kind}/{name}")
    s.registry.annotate(run, f"{kind}/{name}", public=True)
    return {}


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
async def unpublish(request: Request, run_id: str, kind: str, name: str) -> dict:
    s = server_of(request)
    run, _, _ = s.registry.checkpoint(s.auth(request), f"tinker://{run_id}/{kind}/{name}")
    s.registry.annotate(run, f"{kind}/{name}", public=None)
    return {}


@router.get("/checkpoints")
async def all_checkpoints(request: Request) -> dict:
    s = server_of(request)
    tenant = s.auth(request)
    limit, offset = page(request.query_params, 100)
    out = [checkpoint_json(c) for r in s.registry.runs_of(tenant.id) for c in s.registry.checkpoints(r)]
    out.sort(key=lambda c: c["time"], reverse=True)
    mine = out[offset : offset + limit]
    return {"checkpoints": mine, "cursor": {"offset": offset, "limit": limit, "total_count": len(out)}}


@router.post("/weights_info")
async def weights_info(request: Request) -> dict:
    s = server_of(request)
    tenant = s.auth(request)
    path = field(await body(request), "tinker_path", str, required=True)
    run, _, _ = s.registry.checkpoint(tenant, path, read=True)
    return {"base_model": run.base_model, "is_lora": True, "lora_rank": run.rank}


def check_ttl(ttl: int | None) -> int | None:
    """A checkpoint TTL in seconds: None (never expires) or 1 s to 10 years."""
    if ttl is not None and not 1 <= ttl <= MAX_TTL:
        raise BadRequest(f"ttl_seconds must be 1..{MAX_TTL} (10 years) or null (never expires), got {ttl}")
    return ttl


def save_options(data: dict) -> dict[str, Any]:
    """A save request's ``path`` (the name), ``ttl_seconds``, ``user_metadata`` and
    ``overwrite``, checked."""
    meta = field(data, "user_metadata", dict, default=None)
    if meta is not None and not all(isinstance(v, str) for v in meta.values()):
        raise BadRequest("user_metadata must map names to strings")
    name = field(data, "path", str, default=None)
    return {
        "name": check_name(name, "field 'path' (the checkpoint name)") if name else name,
        "ttl": check_ttl(field(data, "ttl_seconds", int, default=None)),
        "meta": meta,
        "overwrite": field(data, "overwrite", bool, default=True),
    }


def save(
    s: Server,
    run: Run,
    kind: str,
    optimizer: bool,
    name: str | None = None,
    ttl: int | None = None,
    meta: dict | None = None,
    overwrite: bool = True,
) -> str:
    """Save the run's adapter as ``<kind>/<name>`` (a timestamped name by default); its path.
    ``save_options`` gives the rest: a TTL in seconds, user metadata, and whether an existing
    checkpoint of that name may be replaced (``overwrite``)."""
    name = name or f"{kind.split('_')[0]}-{int(time.time() * 1000)}"
    check_name(name, "the checkpoint name")
    folder = s.registry.folder(run) / kind / name
    if folder.exists() and not overwrite:
        raise BadRequest(
            f"checkpoint {kind}/{name} exists already; pass overwrite=True or choose another name"
        )
    s.engine.core.save(run.adapter, folder, optimizer)
    copy_to = (run.user_metadata or {}).get(SAVE_DIR)
    if copy_to:  # checked at the run's start: a keyless server's own folder
        shutil.copytree(folder, Path(copy_to) / kind / name, dirs_exist_ok=True)
    s.registry.annotate(
        run,
        f"{kind}/{name}",
        expires_at=None if ttl is None else time.time() + ttl,
        user_metadata=meta,
    )
    return f"tinker://{run.id}/{kind}/{name}"
