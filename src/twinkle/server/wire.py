"""The Tinker SDK's binary bodies: ``forward_backward`` requests come as the SDK's protobuf
``ForwardBackwardRequest``, and the results of ``forward_backward`` and ``asample`` go back as
its ``ForwardBackwardOutput`` and ``SampleResponse`` messages (the SDK accepts no JSON for
those two). Every other body is JSON. The message classes are the SDK's own
(``tinker.proto.tinker_public_pb2``), so the wire format is the pinned SDK's.

Decoded datums are checked here: each bad field is a ``BadRequest`` naming it. An image chunk
is kept as sent (``ImageIn``: its bytes, format, declared token count and where it sits among
the text tokens) until ``twinkle.server.images`` turns it into the model's inputs. Of the request
message's fields, ``seq_id`` is not read (each key's requests already run in the order they
arrive) and a datum's provenance spans are refused (they reference the stability info that
``record_stability_info`` records, which the sampling route refuses)."""

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from twinkle.server.errors import BadRequest

_NUMPY = {1: np.float32, 2: np.int64, 3: np.int32, 4: np.uint16}  # the proto DType values


def _pb() -> Any:
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclass
class ImageIn:
    """An ``ImageChunk`` as sent: ``at`` is the number of text tokens before it; ``expected``
    the token count the client declares (None: not declared)."""

    at: int
    data: bytes
    format: str
    expected: int | None


@dataclass
class Datum:
    """One training example: input tokens and the per-token loss inputs (flat arrays of the
    same length as ``tokens``). ``images``: the image chunks not yet placed; ``vision``: the
    model's image inputs (``pixel_values``, ``image_grid_thw``) once they are, their
    placeholder tokens then being in ``tokens`` (``twinkle.server.images``)."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    images: list[ImageIn] = field(default_factory=list)
    vision: dict[str, np.ndarray] | None = None


@dataclass
class FwdBwd:
    model_id: str
    loss_fn: str
    loss_config: dict[str, Any]
    data: list[Datum]
    forward_only: bool


# the inputs that keep their shape (n, k) (``twinkle.server.model_steps``); every other is flat
WIDE = ("teacher_topk_logprobs", "teacher_topk_indices")
# a row's processed images as upstream's ``input_feature_to_datum`` sends them, kept 2-D
# (``twinkle.server.images``): (patches, patch values) and (images, 3)
IMAGE_INPUTS = ("pixel_values", "image_grid_thw")


def _tensor(msg: Any, where: str, wide: bool = False) -> np.ndarray:
    pb = _pb()
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None or msg.dtype == pb.DTYPE_BFLOAT16:
        raise BadRequest(f"{where}: unsupported tensor dtype {msg.dtype}; send float32 or int64")
    if msg.HasField("sparse_csr"):
        raise BadRequest(f"{where}: sparse tensors are not supported; send a dense array")
    if len(msg.dense) % np.dtype(dtype).itemsize:
        raise BadRequest(f"{where}: {len(msg.dense)} bytes is not a whole number of {np.dtype(dtype).name}")
    values = np.frombuffer(msg.dense, dtype=dtype)
    if list(msg.shape) and math.prod(msg.shape) != values.size:
        raise BadRequest(f"{where}: shape {list(msg.shape)} does not hold {values.size} values")
    return values.reshape(list(msg.shape)) if wide and len(msg.shape) == 2 else values.reshape(-1)


def decode_forward_backward(body: bytes, max_datums: int, max_tokens: int) -> FwdBwd:
    """The request in ``body``, checked: token ids, lengths and finite float inputs."""
    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 (protobuf's DecodeError and friends)
        raise BadRequest(
            f"the forward_backward body is not a ForwardBackwardRequest message ({exc})"
        ) from exc
    if not msg.model_id:
        raise BadRequest("forward_backward: model_id is missing")
    if len(msg.data) == 0:
        raise BadRequest("forward_backward: data is empty; send at least one Datum")
    if len(msg.data) > max_datums:
        raise BadRequest(
            f"forward_backward: {len(msg.data)} datums is more than this server's limit of {max_datums} per request",
            status=413,
        )
    config: dict[str, Any] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data, total = [], 0
    for i, datum in enumerate(msg.data):
        if len(datum.model_input_spans) or len(datum.loss_fn_input_spans):
            raise BadRequest(
                f"datum {i}: provenance spans (model_input_spans, loss_fn_input_spans) are not "
                "supported: they point at the sampler's recorded stability info, which twinkle "
                "server does not record; send the datum without them"
            )
        tokens, images = _model_input(datum.model_input, i)
        total += tokens.size + sum(image.expected or 0 for image in images)
        inputs = {
            name: _tensor(t, f"datum {i} loss_fn_inputs[{name!r}]", wide=name in WIDE + IMAGE_INPUTS)
            for name, t in datum.loss_fn_inputs.items()
        }
        data.append(Datum(tokens, inputs, images))
    if total > max_tokens:
        raise BadRequest(
            f"forward_backward: {total} tokens is more than this server's limit of {max_tokens} per request",
            status=413,
        )
    return FwdBwd(msg.model_id, msg.loss_fn, config, data, bool(msg.forward_only))


def _model_input(chunks: Any, i: int) -> tuple[np.ndarray, list[ImageIn]]:
    """The text chunks' tokens end to end, and each image chunk where it sits among them."""
    parts: list[np.ndarray] = []
    images: list[ImageIn] = []
    at = 0
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk")
        if kind == "encoded_text":
            parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).astype(np.int64))
            at += parts[-1].size
        elif kind == "image":
            image = chunk.image
            if image.HasField("override_dimensions"):
                raise BadRequest(
                    f"datum {i}: image {len(images)}: override_dimensions is not supported; send the "
                    "image at the size it is to be seen"
                )
            expected = int(image.expected_tokens) if image.HasField("expected_tokens") else None
            images.append(ImageIn(at, bytes(image.data), image.format, expected))
        else:
            raise BadRequest(
                f"datum {i}: {kind or 'empty'} chunks are not supported; send text and image chunks"
            )
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return tokens, images


def check_datum(datum: Datum, i: int, vocab: int, needs: tuple[str, ...]) -> None:
    """``BadRequest`` unless the datum has tokens in the vocabulary, every input in ``needs``,
    each of the token count's length, and only finite floats."""
    n = datum.tokens.size
    if n == 0:
        raise BadRequest(f"datum {i}: model_input has no tokens")
    if int(datum.tokens.min()) < 0 or int(datum.tokens.max()) >= vocab:
        raise BadRequest(f"datum {i}: a token id is outside the vocabulary [0, {vocab})")
    for name in needs:
        if name not in datum.inputs:
            raise BadRequest(f"datum {i}: loss_fn_inputs lacks {name!r} (this loss needs {', '.join(needs)})")
    for name, values in datum.inputs.items():
        if values.size != n:
            raise BadRequest(
                f"datum {i}: loss_fn_inputs[{name!r}] has {values.size} values for {n} input tokens; "
                "send one per token"
            )
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            raise BadRequest(f"datum {i}: loss_fn_inputs[{name!r}] holds NaN or inf")
    targets = datum.inputs.get("target_tokens")
    if targets is not None and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise BadRequest(f"datum {i}: a target token id is outside the vocabulary [0, {vocab})")


def encode_forward_backward_output(
    per_datum: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """A ``ForwardBackwardOutput`` message: one float32 field per output name, per datum."""
    pb = _pb()
    out = pb.ForwardBackwardOutput()
    out.loss_fn_output_type = "ArrayRecord"
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    record = out.loss_fn_outputs.add()
    record.num_datums = len(per_datum)
    for name in per_datum[0] if per_datum else ():
        arrays = [np.ascontiguousarray(d[name], dtype=np.float32).reshape(-1) for d in per_datum]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        field_msg = record.fields[name]
        field_msg.dtype = pb.DTYPE_FLOAT32
        field_msg.data = b"".join(a.tobytes() for a in arrays)
        field_msg.offsets = offsets.tobytes()
    return out.SerializeToString()


def _topk(msg: Any, topk: tuple[np.ndarray, np.ndarray]) -> None:
    """Fill a ``TopkLogprobs`` message from (token ids, log-probs), each of shape (length, k)."""
    ids, logps = topk
    msg.length, msg.k = int(ids.shape[0]), int(ids.shape[1])
    msg.token_ids = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
    msg.logprobs = np.ascontiguousarray(logps, dtype=np.float32).tobytes()


def _dense(msg: Any, values: np.ndarray, dtype: Any) -> None:
    """Fill a ``Tensor`` message with a dense array of the proto ``dtype`` (float32 or int64)."""
    pb = _pb()
    array = np.ascontiguousarray(values, dtype=np.float32 if dtype == pb.DTYPE_FLOAT32 else np.int64)
    msg.dtype = dtype
    msg.shape.extend(array.shape)
    msg.dense = array.tobytes()


def encode_sample_response(
    sequences: list[tuple[list[int], list[float], str]],
    prompt_logprobs: Any,
    extras: dict[str, Any] | None = None,
) -> bytes:
    """A ``SampleResponse`` message: (tokens, log-probs, "stop"|"length") per sequence, and the
    prompt's log-probs (NaN where not scored: the first token, which has none, and those before
    ``prompt_logprobs_last_n``). ``extras``: ``topk_prompt`` (ids, log-probs) of shape
    (prompt length, k); ``topk_samples``, one such pair per sequence; ``target`` (the float32
    log-probs of ``target_prompt_logprobs``' cells, its shape, its (crow, col) when it was sparse
    CSR: the response keeps the request's layout); ``alt`` (int64 ids, float32 log-probs) of
    ``prompt_alt_tokens``, each of shape (prompt length - 1, k)."""
    pb = _pb()
    extras = extras or {}
    out = pb.SampleResponse()
    for i, (tokens, logprobs, reason) in enumerate(sequences):
        seq = out.sequences.add()
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
        seq.stop_reason = pb.STOP_REASON_STOP if reason == "stop" else pb.STOP_REASON_LENGTH
        if "topk_samples" in extras:
            _topk(seq.topk_sampled_logprobs, extras["topk_samples"][i])
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if "topk_prompt" in extras:
        _topk(out.topk_prompt_logprobs, extras["topk_prompt"])
    if "target" in extras:
        values, shape, csr = extras["target"]
        if csr is None:
            _dense(out.target_prompt_logprobs, np.reshape(values, shape), pb.DTYPE_FLOAT32)
        else:
            msg = out.target_prompt_logprobs
            msg.dtype = pb.DTYPE_FLOAT32
            msg.shape.extend(shape)
            msg.sparse_csr.values = np.ascontiguousarray(values, dtype=np.float32).tobytes()
            msg.sparse_csr.crow_indices = np.asarray(csr[0], dtype=np.int64).tobytes()
            msg.sparse_csr.col_indices = np.asarray(csr[1], dtype=np.int64).tobytes()
    if "alt" in extras:
        ids, logps = extras["alt"]
        _dense(out.prompt_alt_tokens.tokens, ids, pb.DTYPE_INT64)
        _dense(out.prompt_alt_tokens.logprobs, logps, pb.DTYPE_FLOAT32)
    return out.SerializeToString()
