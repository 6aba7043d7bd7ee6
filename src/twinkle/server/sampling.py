"""The sampling routes: a sampler on saved weights (or the base model), ``asample``
(``sample`` and ``compute_logprobs`` of the SDK)."""

from typing import Any

from fastapi import FastAPI, Request

from twinkle.server.app import Server, body, field, future, new_id
from twinkle.server.errors import BadRequest, NotFound
from twinkle.server.runs import check_base
from twinkle.server.wire import encode_sample_response


def add_sampling_routes(app: FastAPI, s: Server) -> None:
    v1 = "/api/v1"

    @app.post(f"{v1}/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        tenant = s.auth(request)
        data = await body(request)
        path = field(data, "model_path", str, default=None)
        if path is None:
            check_base(s, data)
        else:
            s.registry.checkpoint(tenant, path)
        sampler_id = new_id()
        s.samplers[sampler_id] = (tenant.id, path)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.post(f"{v1}/asample")
    async def asample(request: Request) -> dict:
        tenant = s.auth(request)
        data = await body(request)
        sampler_id = field(data, "sampling_session_id", str, default=None)
        if sampler_id is not None:
            owner, path = s.samplers.get(sampler_id, (None, None))
            if owner != tenant.id:
                raise NotFound(f"sampler {sampler_id!r} is not one of this key's")
        else:
            path = field(data, "model_path", str, default=None)
        folder = s.registry.checkpoint(tenant, path) if path else None
        prompt = _prompt_tokens(field(data, "prompt", dict, required=True), s.engine.vocab)
        params = field(data, "sampling_params", dict, default={})
        n = field(data, "num_samples", int, default=1)
        if not 1 <= n <= 64:
            raise BadRequest(f"num_samples must be 1..64, got {n}")
        want_prompt = bool(field(data, "prompt_logprobs", bool, default=False))
        max_tokens = field(params, "max_tokens", int, default=16)
        if not 0 <= max_tokens <= 4096:
            raise BadRequest(f"sampling_params.max_tokens must be 0..4096, got {max_tokens}")
        field(params, "temperature", (int, float), default=1.0)
        seed = field(params, "seed", int, default=0)
        rid = s.queue.submit(tenant.id, lambda: _sample(s, folder, prompt, params, n, want_prompt, seed))
        return {**future(rid), "sample_sequence_ids": [f"{rid}-{i}" for i in range(n)]}


def _prompt_tokens(prompt: dict, vocab: int) -> list[int]:
    chunks = field(prompt, "chunks", list, required=True)
    tokens: list[int] = []
    for chunk in chunks:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise BadRequest("prompt: only encoded_text chunks are supported")
        ids = field(chunk, "tokens", list, required=True)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise BadRequest(f"prompt: tokens must be integers in [0, {vocab})")
        tokens += ids
    if not tokens:
        raise BadRequest("prompt has no tokens")
    return tokens


def _sample(
    s: Server, found: Any, prompt: list[int], params: dict, n: int, want_prompt: bool, seed: int
) -> bytes:
    """Sample from a saved adapter, or from the base model, through an adapter lent a slot for
    the call (without saved weights its LoRA B is zero: exactly the base model)."""
    run, _, folder = found if found is not None else (None, None, None)
    name = f"smp-{new_id()}"
    s.engine.add(name, run.rank if run is not None else 1)
    try:
        if folder is not None:
            s.engine.load(name, folder, optimizer=False)
        prompt_lp = s.engine.prompt_logprobs(name, prompt) if want_prompt else None
        if int(params.get("max_tokens") or 0) == 0:
            seqs = [([], [], "length")] * n
        else:
            seqs = s.engine.sample(name, prompt, params, n, seed)
        return encode_sample_response(seqs, prompt_lp)
    finally:
        s.engine.remove(name)
