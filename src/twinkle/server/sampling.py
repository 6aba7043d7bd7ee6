"""The sampling routes: a sampler on saved weights (or the base model), ``asample``
(``sample`` and ``compute_logprobs`` of the SDK) with the prompt's log-probs, their top-k, the
log-probs of chosen prompt tokens (``target_prompt_logprobs``) and the sampled tokens' top-k.

Every log-prob is the model's at temperature 1, from one forward pass over the prompt (and one
over prompt + completion per sequence for ``topk_sample_logprobs``)."""

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request

from twinkle.server.app import Server, body, field, future, new_id
from twinkle.server.errors import BadRequest, NotFound
from twinkle.server.runs import check_base
from twinkle.server.wire import encode_sample_response

MAX_TOPK = 1024
SENTINEL = (0, -99999.0)  # the SDK's empty top-k entry (tinker.types.topk_logprobs.MASK_LOGPROB)


@dataclass
class Scoring:
    """What a sample request asks to score besides the completions."""

    prompt: bool = False  # include_prompt_logprobs
    last_n: int | None = None  # prompt_logprobs_last_n: only the last n prompt tokens
    topk_prompt: int = 0
    topk_sample: int = 0
    target: np.ndarray | None = None  # int64 (len(prompt) - 1, K); -1 asks for nothing


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
        s.registry.remember_sampler(tenant.id, sampler_id, path)
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
        max_tokens = field(params, "max_tokens", int, default=16)
        if not 0 <= max_tokens <= 4096:
            raise BadRequest(f"sampling_params.max_tokens must be 0..4096, got {max_tokens}")
        field(params, "temperature", (int, float), default=1.0)
        seed = field(params, "seed", int, default=0)
        scoring = _scoring(data, len(prompt), s.engine.vocab)
        rid = s.queue.submit(tenant.id, lambda: _sample(s, folder, prompt, params, n, scoring, seed))
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


def _scoring(data: dict, length: int, vocab: int) -> Scoring:
    """The request's scoring fields, checked; the ones this server lacks are a 400 naming them."""
    if field(data, "prompt_alt_tokens_k", int, default=0):
        raise BadRequest("prompt_alt_tokens_k is not supported by twinkle server; send 0")
    if field(data, "record_stability_info", bool, default=False):
        raise BadRequest("record_stability_info is not supported by twinkle server; leave it unset")
    out = Scoring(prompt=bool(field(data, "prompt_logprobs", bool, default=False)))
    out.topk_prompt = field(data, "topk_prompt_logprobs", int, default=0)
    out.topk_sample = field(data, "topk_sample_logprobs", int, default=0)
    for name in ("topk_prompt", "topk_sample"):
        if not 0 <= getattr(out, name) <= min(MAX_TOPK, vocab):
            raise BadRequest(f"{name}_logprobs must be 0..{min(MAX_TOPK, vocab)}, got {getattr(out, name)}")
    out.last_n = field(data, "prompt_logprobs_last_n", int, default=None)
    if out.last_n is not None and not (out.prompt and 1 <= out.last_n <= length - 1):
        raise BadRequest(
            f"prompt_logprobs_last_n must be 1..{length - 1} (the prompt's length - 1) and needs "
            f"prompt_logprobs, got {out.last_n}"
        )
    target = field(data, "target_prompt_logprobs", dict, default=None)
    if target is not None:
        out.target = _target(target, length, vocab)
    return out


def _target(target: dict, length: int, vocab: int) -> np.ndarray:
    if target.get("sparse_crow_indices") is not None:
        raise BadRequest("target_prompt_logprobs: sparse tensors are not supported; send a dense one")
    values = field(target, "data", list, required=True)
    shape = field(target, "shape", list, default=None)
    if target.get("dtype") != "int64" or not all(isinstance(v, int) for v in values):
        raise BadRequest("target_prompt_logprobs must be an int64 tensor of token ids")
    if shape is None or len(shape) != 2 or shape[0] != length - 1 or shape[0] * shape[1] != len(values):
        raise BadRequest(
            f"target_prompt_logprobs must have shape [{length - 1}, K] (the prompt's length - 1), "
            f"got {shape} with {len(values)} values"
        )
    ids = np.asarray(values, dtype=np.int64).reshape(shape)
    if ((ids < -1) | (ids >= vocab)).any():
        raise BadRequest(f"target_prompt_logprobs: ids must be -1 (nothing) or in [0, {vocab})")
    return ids


def _topk(rows: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` most likely tokens of each row: (ids, log-probs), each (rows, k)."""
    logps, ids = rows.topk(k, dim=-1)
    return ids.numpy(), logps.numpy()


def _score_prompt(s: Server, name: str, prompt: list[int], want: Scoring) -> tuple[Any, dict]:
    """(prompt log-probs or None, the response's prompt extras)."""
    if not (want.prompt or want.topk_prompt or want.target is not None):
        return None, {}
    rows = s.engine.next_token_logps(name, prompt)[:-1]  # row i predicts prompt[i + 1]
    first = 1 if want.last_n is None else len(prompt) - want.last_n  # the first scored position
    extras: dict[str, Any] = {}
    logprobs = None
    if want.prompt:
        picked = rows.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1).numpy()
        logprobs = np.full(len(prompt), np.nan, dtype=np.float32)
        logprobs[first:] = picked[first - 1 :]
    if want.topk_prompt:
        ids = np.full((len(prompt), want.topk_prompt), SENTINEL[0], dtype=np.int32)
        logps = np.full((len(prompt), want.topk_prompt), SENTINEL[1], dtype=np.float32)
        top_ids, top_logps = _topk(rows[first - 1 :], want.topk_prompt)
        ids[first:], logps[first:] = top_ids, top_logps
        extras["topk_prompt"] = (ids, logps)
    if want.target is not None:
        asked = torch.from_numpy(want.target)
        picked = rows.gather(1, asked.clamp(min=0))
        extras["target"] = torch.where(asked >= 0, picked, torch.zeros(())).numpy()
    return (None if logprobs is None else logprobs.tolist()), extras


def _sample(
    s: Server, found: Any, prompt: list[int], params: dict, n: int, want: Scoring, seed: int
) -> bytes:
    """Sample from a saved adapter, or from the base model. On the model: through an adapter lent
    a slot for the call (without saved weights its LoRA B is zero: exactly the base model); when
    every slot is taken, the least recently used training run is parked for it
    (``Server.make_room``). With a sampler group the completions come from there, and the model
    lends a slot only when the request scores the prompt or the samples' top-k."""
    run, _, folder = found if found is not None else (None, None, None)
    rank = run.rank if run is not None else 1
    scores = want.prompt or want.topk_prompt or want.target is not None or want.topk_sample
    name = f"smp-{new_id()}" if scores or not s.engine.has_sampler else None
    if name is not None:
        s.make_room()
        s.engine.add(name, rank)
    try:
        if name is not None and folder is not None:
            s.engine.load(name, folder, optimizer=False)
        prompt_lp, extras = _score_prompt(s, name, prompt, want)
        if int(params.get("max_tokens") or 0) == 0:
            seqs = [([], [], "length")] * n
        elif s.engine.has_sampler:
            seqs = s.engine.sample_checkpoint(folder, rank, prompt, params, n, seed)
        else:
            seqs = s.engine.sample(name, prompt, params, n, seed)
        if want.topk_sample:
            extras["topk_samples"] = [
                _topk(
                    s.engine.next_token_logps(name, prompt + tokens)[len(prompt) - 1 : -1], want.topk_sample
                )
                for tokens, _, _ in seqs
            ]
        return encode_sample_response(seqs, prompt_lp, extras)
    finally:
        if name is not None:
            s.engine.remove(name)
