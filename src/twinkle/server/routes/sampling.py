"""The ``SamplingClient`` routes: a sampler on saved weights (or the base model), ``asample``
(``sample`` and ``compute_logprobs`` of the SDK) with the prompt's log-probs, their top-k, the
log-probs of chosen prompt tokens (``target_prompt_logprobs``, dense or sparse CSR), draws of
alternative prompt tokens (``prompt_alt_tokens_k``) and the sampled tokens' top-k.

Every log-prob is the model's at temperature 1, from one forward pass over the prompt (and one
over prompt + completion per sequence for ``topk_sample_logprobs``); the request's temperature
only shapes the completions and the alternative tokens' draws (``twinkle.server.scoring``). The
request's ``sampling_params`` become the sampler's ``SamplingParams`` in one place,
``twinkle.server.sampler_calls.sampling_params``: the route checks them by building them there.

On a vision-language base model a prompt may hold ``ImageChunk``s: they are placed as
training's datums are (``twinkle.server.images``), and every forward over the prompt, the
scores' and the sampler's alike, is given its images."""

import base64
import binascii
import functools
from collections.abc import Generator
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from twinkle.server import images
from twinkle.server.errors import BadRequest
from twinkle.server.requests import body, field, future, new_id, server_of
from twinkle.server.runs import check_base
from twinkle.server.sampler_calls import Images, sampling_params
from twinkle.server.scoring import Scoring
from twinkle.server.service import Server
from twinkle.server.state import Tenant
from twinkle.server.wire import Datum, ImageIn, encode_sample_response
from twinkle.utils.errors import UserError

router = APIRouter(prefix="/api/v1")
SLICE_SECONDS = 0.05  # decoding between two turns of the queue: another tenant waits at most this
MAX_TOPK = 1024  # the widest top-k, and the most alternative tokens drawn per prompt position


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request) -> dict:
    s = server_of(request)
    tenant = s.auth(request)
    data = await body(request)
    path = field(data, "model_path", str, default=None)
    if path is None:
        check_base(s, data)
    else:
        s.registry.checkpoint(tenant, path, read=True)
    sampler_id = new_id()
    s.registry.remember_sampler(tenant.id, sampler_id, path)
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


@router.get("/samplers/{sampler_id}")
async def sampler(request: Request, sampler_id: str) -> dict:
    s = server_of(request)
    tenant = s.auth(request)
    path = s.registry.sampler_path(tenant, sampler_id)
    return {"sampler_id": sampler_id, "base_model": s.base_model, "model_path": path}


@router.post("/asample")
async def asample(request: Request) -> dict:
    s = server_of(request)
    tenant = s.auth(request)
    data = await body(request)
    sampler_id = field(data, "sampling_session_id", str, default=None)
    if sampler_id is not None:
        path = s.registry.sampler_path(tenant, sampler_id)
    else:
        path = field(data, "model_path", str, default=None)
    folder = s.registry.checkpoint(tenant, path, read=True) if path else None
    prompt, vision = await _placed_prompt(s, field(data, "prompt", dict, required=True))
    params = field(data, "sampling_params", dict, default={})
    n = field(data, "num_samples", int, default=1)
    if not 1 <= n <= 64:
        raise BadRequest(f"num_samples must be 1..64, got {n}")
    max_tokens = field(params, "max_tokens", int, default=16)
    if not 0 <= max_tokens <= 4096:
        raise BadRequest(f"sampling_params.max_tokens must be 0..4096, got {max_tokens}")
    temperature = field(params, "temperature", (int, float), default=1.0)
    if temperature < 0:
        raise BadRequest(f"sampling_params.temperature must be 0 (greedy) or more, got {temperature}")
    seed = field(params, "seed", int, default=0)
    _check_sampling_params(params, n, seed)
    scoring = _scoring(data, len(prompt), s.engine.vocab)
    scoring.temperature, scoring.seed = float(temperature), seed
    _check_cost(s, tenant, len(prompt), n, max_tokens, scoring)
    rid = s.queue.submit(
        tenant.id, lambda: _sample(s, tenant, folder, prompt, vision, params, n, scoring, seed), lane="sample"
    )
    return {**future(rid), "sample_sequence_ids": [f"{rid}-{i}" for i in range(n)]}


def _check_sampling_params(params: dict, n: int, seed: int) -> None:
    """``sampling_params``' other fields (``top_p``, ``top_k``, ``stop``) checked as the sampler
    reads them: their JSON kinds here, their values by building the sampler's ``SamplingParams``
    (``sampler_calls.sampling_params``); a bad one is a 400 naming it, before the request is queued."""
    field(params, "top_p", (int, float), default=1.0)
    field(params, "top_k", int, default=-1)
    field(params, "stop", (str, list), default=None)
    try:
        sampling_params(params, n, seed)
    except UserError as exc:
        raise BadRequest(f"sampling_params: {exc}") from None


def _check_cost(s: Server, tenant: Tenant, length: int, n: int, max_tokens: int, want: Scoring) -> None:
    """Refuse, before it is queued, a request the model cannot take (a prompt longer than its
    positions) or that costs more tokens than the key may spend on one request (``max_tokens``):
    the prompt, ``n`` completions of up to ``max_tokens``, and a pass over prompt + completion per
    sequence for ``topk_sample_logprobs``."""
    context = s.engine.context
    if context is not None and length + (max_tokens > 0) > context:
        raise BadRequest(
            f"prompt has {length} tokens; the model takes at most {context} positions"
            + (" (one left for the first sampled token)" if max_tokens > 0 else "")
        )
    cost = length + n * max_tokens + (n * (length + max_tokens) if want.topk_sample else 0)
    if cost > tenant.limits.max_tokens:
        raise BadRequest(
            f"this sample request costs {cost} tokens (prompt {length} + num_samples {n} x max_tokens "
            f"{max_tokens}{', and their top-k passes' if want.topk_sample else ''}), over this key's "
            f"max_tokens of {tenant.limits.max_tokens}; ask for fewer samples or tokens",
            status=413,
        )


async def _placed_prompt(s: Server, prompt: dict) -> tuple[list[int], Images]:
    """The prompt's tokens and its placed images (``twinkle.server.images``: each image chunk
    decoded, processed by the served model's image processor and replaced by its placeholder
    tokens), or None for a prompt without any. Placed here, before the request is queued, so the
    length checks and the scoring fields' shapes see the prompt the model runs, and a bad image
    is a 400 at once; decoding and processing run in a worker thread, off the event loop."""
    tokens, chunks = _prompt_chunks(prompt, s.engine.vocab)
    if s.engine.vision is None and not chunks:
        return tokens, None
    datum = Datum(np.asarray(tokens, dtype=np.int64), images=chunks)
    place = functools.partial(images.place_images, [datum], s.engine.vision, s.base_model, ["prompt"])
    if chunks:
        await run_in_threadpool(place)
    else:
        place()  # a text prompt: only its loose image placeholders are looked for
    return datum.tokens.tolist(), datum.vision


def _prompt_chunks(prompt: dict, vocab: int) -> tuple[list[int], list[ImageIn]]:
    """The text chunks' tokens end to end, and each image chunk where it sits among them."""
    chunks = field(prompt, "chunks", list, required=True)
    tokens: list[int] = []
    pictures: list[ImageIn] = []
    for chunk in chunks:
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind == "image":
            pictures.append(_image_chunk(chunk, len(pictures), len(tokens)))
            continue
        if kind != "encoded_text":
            raise BadRequest("prompt: only encoded_text and image chunks are supported")
        ids = field(chunk, "tokens", list, required=True)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise BadRequest(f"prompt: tokens must be integers in [0, {vocab})")
        tokens += ids
    if not tokens and not pictures:
        raise BadRequest("prompt has no tokens")
    return tokens, pictures


def _image_chunk(chunk: dict, j: int, at: int) -> ImageIn:
    """An ``ImageChunk`` as the SDK sends it in JSON (its bytes in base64), checked."""
    where = f"prompt: image {j}"
    data = field(chunk, "data", str, required=True)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(
            f"{where}: data must be the image's bytes in base64 (as the SDK sends them)"
        ) from None
    expected = field(chunk, "expected_tokens", int, default=None)
    if expected is not None and expected < 1:
        raise BadRequest(f"{where}: expected_tokens must be at least 1, got {expected}")
    return ImageIn(at, raw, field(chunk, "format", str, required=True), expected)


def _scoring(data: dict, length: int, vocab: int) -> Scoring:
    """The request's scoring fields, checked; the ones this server lacks are a 400 naming them."""
    if field(data, "record_stability_info", bool, default=False):
        raise BadRequest("record_stability_info is not supported by twinkle server; leave it unset")
    out = Scoring(prompt=bool(field(data, "prompt_logprobs", bool, default=False)))
    out.topk_prompt = field(data, "topk_prompt_logprobs", int, default=0)
    out.topk_sample = field(data, "topk_sample_logprobs", int, default=0)
    for name in ("topk_prompt", "topk_sample"):
        if not 0 <= getattr(out, name) <= min(MAX_TOPK, vocab):
            raise BadRequest(f"{name}_logprobs must be 0..{min(MAX_TOPK, vocab)}, got {getattr(out, name)}")
    out.alt_k = field(data, "prompt_alt_tokens_k", int, default=0)
    if not 0 <= out.alt_k <= MAX_TOPK:
        raise BadRequest(
            f"prompt_alt_tokens_k must be 0..{MAX_TOPK} (draws per prompt position), got {out.alt_k}"
        )
    out.last_n = field(data, "prompt_logprobs_last_n", int, default=None)
    if out.last_n is not None and not (out.prompt and 1 <= out.last_n <= length - 1):
        raise BadRequest(
            f"prompt_logprobs_last_n must be 1..{length - 1} (the prompt's length - 1) and needs "
            f"prompt_logprobs, got {out.last_n}"
        )
    target = field(data, "target_prompt_logprobs", dict, default=None)
    if target is not None:
        _target(out, target, length, vocab)
    return out


def _target(out: Scoring, target: dict, length: int, vocab: int) -> None:
    """``target_prompt_logprobs`` (int64 ids, shape ``[length - 1, K]``, dense or sparse CSR) as
    the cells to score, in the order the response lists their log-probs."""
    values = field(target, "data", list, required=True)
    shape = field(target, "shape", list, default=None)
    if target.get("dtype") != "int64" or not all(_is_int(v) for v in values):
        raise BadRequest("target_prompt_logprobs must be an int64 tensor of token ids")
    if (
        shape is None
        or len(shape) != 2
        or not all(_is_int(n) and n >= 0 for n in shape)
        or shape[0] != length - 1
    ):
        raise BadRequest(
            f"target_prompt_logprobs must have shape [{length - 1}, K] (the prompt's length - 1), got {shape}"
        )
    ids = np.asarray(values, dtype=np.int64)
    if ((ids < -1) | (ids >= vocab)).any():
        raise BadRequest(f"target_prompt_logprobs: ids must be -1 (nothing) or in [0, {vocab})")
    crow = field(target, "sparse_crow_indices", list, default=None)
    col = field(target, "sparse_col_indices", list, default=None)
    if crow is None and col is None:
        if shape[0] * shape[1] != ids.size:
            raise BadRequest(f"target_prompt_logprobs: shape {shape} does not hold {ids.size} values")
        rows = np.repeat(np.arange(shape[0], dtype=np.int64), shape[1])
    else:
        rows = _csr_rows(crow, col, shape, ids.size)
        out.target_csr = (crow, col)
    out.target_rows, out.target_ids, out.target_shape = rows, ids, (shape[0], shape[1])


def _csr_rows(crow: list | None, col: list | None, shape: list[int], nnz: int) -> np.ndarray:
    """The row of each listed cell of a sparse CSR tensor, its layout checked (torch's invariants:
    row pointers from 0 to the number of values, sorted distinct columns within a row)."""
    where = "target_prompt_logprobs (sparse CSR)"
    if crow is None or col is None:
        raise BadRequest(f"{where}: send both sparse_crow_indices and sparse_col_indices")
    if not all(_is_int(v) for v in crow + col):
        raise BadRequest(f"{where}: the indices must be integers")
    pointers, columns = np.asarray(crow, dtype=np.int64), np.asarray(col, dtype=np.int64)
    if (
        pointers.size != shape[0] + 1
        or pointers[0] != 0
        or pointers[-1] != nnz
        or (np.diff(pointers) < 0).any()
    ):
        raise BadRequest(
            f"{where}: sparse_crow_indices must be {shape[0] + 1} non-decreasing row pointers from 0 to "
            f"the {nnz} values"
        )
    rows = np.repeat(np.arange(shape[0], dtype=np.int64), np.diff(pointers))
    if columns.size != nnz or ((columns < 0) | (columns >= shape[1])).any():
        raise BadRequest(f"{where}: sparse_col_indices must be {nnz} columns in [0, {shape[1]})")
    if ((np.diff(columns) <= 0) & (np.diff(rows) == 0)).any():
        raise BadRequest(f"{where}: the columns of a row must be sorted and distinct")
    return rows


def _is_int(value: Any) -> bool:
    """An integer that numpy's int64 holds (JSON integers have no bound)."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**62) < value < 2**62


def _sample(
    s: Server,
    tenant: Tenant,
    found: Any,
    prompt: list[int],
    vision: Images,
    params: dict,
    n: int,
    want: Scoring,
    seed: int,
) -> Generator[None, None, bytes]:
    """Sample from a saved adapter, or from the base model. On the model: through an adapter lent
    a slot for the call (without saved weights its LoRA B is zero: exactly the base model); when
    every slot is taken, the least recently used training run is parked for it
    (``Server.make_room``). With a sampler group the completions come from there, and the model
    lends a slot only when the request scores the prompt or the samples' top-k. ``vision``: the
    prompt's placed images, which every forward over the prompt is given (the scores, the
    samples' top-k and the sampling: ``ModelCore.sample_steps`` says where it decodes them).

    A generator: sampling on the model in this process runs in slices (``ModelCore.sample_steps``),
    and the queue runs other requests between them; the adapter keeps its slot meanwhile."""
    run, _, folder = found if found is not None else (None, None, None)
    rank = run.rank if run is not None else 1
    on_model = want.of_prompt or want.topk_sample or not s.engine.has_sampler
    name = f"smp-{new_id()}" if on_model else None
    if name is not None:
        s.make_room()
        s.engine.add(name, rank)
    try:
        if name is not None and folder is not None:
            s.engine.core.load_for_sampling(name, folder)
        scores = s.engine.core.score_prompt(name, prompt, want, vision) if want.of_prompt else {}
        if int(params.get("max_tokens") or 0) == 0:
            seqs = [([], [], "length")] * n
        elif s.engine.has_sampler:
            seqs = s.engine.sample_checkpoint(folder, rank, prompt, params, n, seed, vision)
        elif s.engine.sliced:
            seqs = yield from s.engine.core.sample_steps(name, prompt, params, n, seed, SLICE_SECONDS, vision)
        else:
            seqs = s.engine.core.sample(name, prompt, params, n, seed, vision)
        s.metrics.counted(tenant.id, "sampled", sum(len(tokens) for tokens, _, _ in seqs))
        extras = {k: v for k, v in scores.items() if k in ("topk_prompt", "alt")}
        if "target" in scores:
            extras["target"] = (scores["target"], want.target_shape, want.target_csr)
        if want.topk_sample:
            extras["topk_samples"] = s.engine.core.topk_of_completions(
                name, prompt, [tokens for tokens, _, _ in seqs], want.topk_sample, vision
            )
        return encode_sample_response(seqs, scores.get("prompt"), extras)
    finally:
        if name is not None:
            s.engine.remove(name)
