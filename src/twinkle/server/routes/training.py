"""The ``TrainingClient`` routes: create a training run (a LoRA adapter on the served model), its
info, unload it, ``forward_backward`` and ``optim_step``; and the ``RestClient``'s listing of
the key's runs. Work on the model is queued on the run (``Server.on_run``) and answered with a
future; the request's datums and AdamW parameters are checked in that queued step, so a bad one
fails the future, as Tinker's does."""

import math
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request

from twinkle.server import images, model_steps, objectives
from twinkle.server.checks import page
from twinkle.server.datums import LOSS_INPUTS
from twinkle.server.errors import BadRequest
from twinkle.server.requests import PROTO, body, field, future, server_of
from twinkle.server.runs import SAVE_DIR, check_base, checkpoint_json, iso, open_run, start_run
from twinkle.server.service import Server
from twinkle.server.state import Run
from twinkle.server.wire import Datum, check_datum, decode_forward_backward, encode_forward_backward_output

router = APIRouter(prefix="/api/v1")


@router.post("/create_model")
async def create_model(request: Request) -> dict:
    s = server_of(request)
    tenant = s.auth(request)
    data = await body(request)
    base = check_base(s, data)
    lora = field(data, "lora_config", dict, default={"rank": 32})
    rank = open_run(s, tenant, field(lora, "rank", int, required=True))
    seed = field(lora, "seed", int, default=0)
    meta = field(data, "user_metadata", dict, default=None)
    check_save_dir(s, meta)
    rid = s.queue.submit(
        tenant.id,
        lambda: {
            "model_id": start_run(s, tenant, base, rank, seed, user_metadata=meta).id,
            "type": "create_model",
        },
    )
    return future(rid)


@router.post("/get_info")
async def get_info(request: Request) -> dict:
    s = server_of(request)
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


@router.post("/unload_model")
async def unload_model(request: Request) -> dict:
    s = server_of(request)
    tenant = s.auth(request)
    run = s.registry.run_of(tenant, field(await body(request), "model_id", str))

    def unload() -> dict:
        s.engine.remove(run.adapter)
        run.live, run.parked, run.window = False, None, None
        return {"model_id": run.id, "type": "unload_model"}

    return future(s.on_run(tenant, run, unload), run.id)


@router.post("/forward_backward")
async def forward_backward(request: Request) -> dict:
    s = server_of(request)
    tenant = s.auth(request)
    if PROTO not in request.headers.get("content-type", ""):
        raise BadRequest(
            f"forward_backward takes a protobuf body (Content-Type: {PROTO}), as the Tinker SDK sends"
        )
    req = decode_forward_backward(await request.body(), tenant.limits.max_datums, tenant.limits.max_tokens)
    run = s.registry.run_of(tenant, req.model_id)
    direct = model_steps.wanted(req.loss_config)  # GKD, embeddings: the model's own step
    composite = not direct and objectives.wanted(req.loss_fn, req.loss_config, req.data)
    if direct:
        loss, task = model_steps.build(req.loss_config, req.forward_only)
    else:
        objectives.check_config(req.loss_fn, req.loss_config, req.forward_only, composite)
        loss = objectives.build(req.loss_fn, req.loss_config) if composite else None

    def step() -> bytes:
        start = time.perf_counter()
        images.place_images(req.data, s.engine.vision, run.base_model)
        if direct and any(d.vision is not None for d in req.data):
            what = req.loss_config.get(model_steps.LOSS_KEY) or f"task {task!r}"
            raise BadRequest(f"loss_fn_config: {what} does not take images here; send text datums")
        placed = sum(d.tokens.size for d in req.data)
        if placed > tenant.limits.max_tokens:
            raise BadRequest(
                f"forward_backward: {placed} tokens with the images' is more than this server's limit of "
                f"{tenant.limits.max_tokens} per request",
                status=413,
            )
        if direct and task == model_steps.EMBEDDING:
            model_steps.check_embedding(req.data, s.engine.vocab, marks=loss is not None)
        elif direct:
            model_steps.check_teacher(req.data, s.engine.vocab)
        elif loss is not None:
            check_composite(req.data, loss, s.engine.vocab)
        else:
            check_datums(req.data, req.loss_fn, s.engine.vocab)
        run.window = run.window or objectives.Window()
        try:
            if direct:
                outs, metrics = model_steps.run(
                    s.engine.core, run.adapter, req.data, loss, task, req.forward_only, run.window
                )
            elif loss is not None:
                outs, metrics = objectives.run(
                    s.engine.core, run.adapter, req.data, loss, req.forward_only, run.window
                )
            else:
                outs, metrics = s.engine.core.run_datums(
                    run.adapter, req.data, req.loss_fn, req.loss_config, req.forward_only
                )
        except Exception:
            run.window = None  # a non-finite loss drops the window's gradients (ModelCore._diverged)
            raise
        tokens = sum(d.tokens.size for d in req.data)
        s.metrics.counted(tenant.id, "trained", tokens)
        seconds = round(time.perf_counter() - start, 4)
        op = "forward" if req.forward_only else "forward_backward"
        s.registry.log(
            run, {"op": op, "datums": len(req.data), "tokens": tokens, "seconds": seconds, **metrics}
        )
        return encode_forward_backward_output(outs, metrics)

    return future(s.on_run(tenant, run, step), run.id)


def check_save_dir(s: Server, meta: dict | None) -> None:
    """``user_metadata[SAVE_DIR]`` (``twinkle_client``'s ``add_adapter_to_model(save_dir=)``,
    upstream's folder on the server for a run's checkpoints): an existing folder, taken only by a
    server without keys (its one local user owns the machine's files; a tenant may not write
    where it likes)."""
    where = (meta or {}).get(SAVE_DIR)
    if where is None:
        return
    if not s.config.keyless:
        raise BadRequest(
            f"user_metadata[{SAVE_DIR!r}] (save_dir) writes to the server's files; only a server "
            "started without keys takes it; leave save_dir out"
        )
    if not isinstance(where, str) or not Path(where).is_absolute() or not Path(where).is_dir():
        raise BadRequest(f"save_dir {where!r} must be an absolute path to an existing folder on the server")


def check_datums(data: list[Datum], loss_fn: str, vocab: int) -> None:
    """The loss is one the server has, and each datum carries what it consumes (``LOSS_INPUTS``)
    with token ids in the vocabulary (``wire.check_datum``)."""
    if loss_fn not in LOSS_INPUTS:
        raise BadRequest(f"loss_fn {loss_fn!r} is not supported; use one of {', '.join(LOSS_INPUTS)}")
    for i, d in enumerate(data):
        extra = sorted(set(d.inputs) - set(LOSS_INPUTS[loss_fn]))
        if extra:
            raise BadRequest(
                f"datum {i}: loss_fn_inputs {extra[0]!r} is not read by loss_fn {loss_fn!r} "
                f"(it reads {', '.join(LOSS_INPUTS[loss_fn])})"
            )
        check_datum(d, i, vocab, LOSS_INPUTS[loss_fn])


def check_composite(data: list[Datum], loss: object, vocab: int) -> None:
    """Each datum of a twinkle loss (``twinkle.server.objectives``) carries what it reads."""
    objectives.check_inputs(loss, data)
    for i, d in enumerate(data):
        check_datum(d, i, vocab, ("target_tokens", "weights"))


@router.post("/optim_step")
async def optim_step(request: Request) -> dict:
    s = server_of(request)
    tenant = s.auth(request)
    data = await body(request)
    run = s.registry.run_of(tenant, field(data, "model_id", str))
    adam = optim_params(data)
    for k in adam:
        if k != "type":
            field(adam, k, (int, float))

    def step() -> dict:
        # the window is reported by this step, or dropped with its gradients if the step fails
        window, run.window = run.window, None
        metrics = s.engine.core.optim_step(run.adapter, *adamw(adam))
        s.registry.log(run, {"op": "optim_step", "lr": adam.get("learning_rate"), **metrics})
        return {"metrics": {**metrics, **(window.report() if window is not None else {})}}

    return future(s.on_run(tenant, run, step), run.id)


OPTIM_PARAMS = ("adam_params", "optim_params", "optimizer_params")  # the SDK's names for them


def optim_params(data: Any) -> Any:
    """The step's parameters, under whichever of the SDK's three names the request uses (it
    sends ``adam_params`` for ``AdamParams``, ``optimizer_params`` for another family's, whose
    ``type`` the field table refuses); ``BadRequest`` when two are sent. None sent: Tinker's
    defaults."""
    given = [name for name in OPTIM_PARAMS if name in data]
    if len(given) > 1:
        raise BadRequest(f"optim_step: send one of {', '.join(given)}, not several")
    return field(data, given[0], dict, default={}) if given else {}


def adamw(adam: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """Tinker's ``adam_params`` (``learning_rate``, ``beta1``, ``beta2``, ``eps``,
    ``weight_decay``, ``grad_clip_norm``; Tinker's defaults) as (torch AdamW's keyword
    arguments, the gradient norm to clip to, 0 for none)."""
    params = {
        "lr": float(adam.get("learning_rate", 1e-4)),
        "betas": (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95))),
        "eps": float(adam.get("eps", 1e-12)),
        "weight_decay": float(adam.get("weight_decay", 0.0)),
    }
    bad = [k for k, v in adam.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad or params["lr"] < 0:
        raise BadRequest(
            f"adam_params: {', '.join(bad) or 'learning_rate'} must be a finite non-negative number"
        )
    return params, float(adam.get("grad_clip_norm", 0.0) or 0.0)


@router.get("/training_runs")
async def training_runs(request: Request) -> dict:
    s = server_of(request)
    tenant = s.auth(request)
    limit, offset = page(request.query_params, 20)
    mine = sorted(s.registry.runs_of(tenant.id), key=lambda r: r.created)
    return {
        "training_runs": [run_json(s, r) for r in mine[offset : offset + limit]],
        "cursor": {"offset": offset, "limit": limit, "total_count": len(mine)},
    }


@router.get("/training_runs/{run_id}")
async def training_run(request: Request, run_id: str) -> dict:
    s = server_of(request)
    return run_json(s, s.registry.run_of(s.auth(request), run_id, live=False))


def run_json(s: Server, run: Run) -> dict:
    """A run as the ``RestClient`` reads it, with its last checkpoint of each kind."""
    last = {c["checkpoint_type"]: checkpoint_json(c) for c in s.registry.checkpoints(run)}
    return {
        "training_run_id": run.id,
        "base_model": run.base_model,
        "model_owner": run.tenant,
        "is_lora": True,
        "lora_rank": run.rank,
        "last_request_time": iso(run.last_request),
        "last_checkpoint": last.get("training"),
        "last_sampler_checkpoint": last.get("sampler"),
        "user_metadata": run.user_metadata,
    }
