"""Twinkle losses the model runs on the request itself, over the Tinker ``forward_backward``
route: ``GKDLoss`` (distillation from a teacher's top-k log-probabilities) and the embedding task
(``InfonceLoss``, pooled rows). Neither is a function of the targets' log-probabilities alone
(``twinkle.server.objectives``): GKD reads the student's whole distribution at each position and
InfoNCE the pooled hidden states. So the request goes to the served model's own
``forward_backward`` / ``forward_only`` with the loss and its inputs, the step the local API
runs, averaged by the loss's own count (tokens for GKD, groups for InfoNCE) as the local window
averages it.

A request names them in ``loss_fn_config`` (its ``loss_fn`` is not read):

- ``{"twinkle_loss": "GKDLoss", "beta": .., "temperature": .., "topk": ..}``; every datum is a
  shifted Tinker datum (``target_tokens``, ``weights``: 1 on the distilled targets) that also
  carries the teacher's top-k at each of its positions, row ``i`` the teacher's distribution of
  ``target_tokens[i]``: ``teacher_topk_logprobs`` ``(n, k)`` float32 (``-inf`` allowed: a token
  the teacher rules out) and ``teacher_topk_indices`` ``(n, k)`` int64, ``n`` the datum's input
  tokens and ``k`` the same in every datum. Per datum the output is ``logprobs``, the student's
  log-probability of each target (0 where the weight is 0).
- ``{"twinkle_task": "embedding", "twinkle_loss": "InfonceLoss", <its arguments>}``: every datum
  is one text, its ``model_input`` the whole row (not shifted), with one input ``labels`` of one
  int64 value: 1 where a group starts (its anchor), 0 for the group's positive and negatives,
  upstream's row marks. The rows of a request are the batch the in-batch negatives are drawn
  from (the SDK sends up to ``fwdbwd_max_chunk_len`` datums as one request). Per datum the
  output is ``embeddings``, the row's L2-normalised pooled embedding. ``forward`` (forward_only)
  also takes rows without ``labels`` and no ``twinkle_loss``: the embeddings of texts for search.

Metrics: ``loss:sum`` (the loss times its count), ``loss:mean`` and ``num_tokens:sum`` (the
count: tokens, or groups); an embedding pass without a loss reports ``num_tokens:sum`` 0 only."""

from typing import Any

import numpy as np
import torch

from twinkle.server.errors import BadRequest
from twinkle.server.objectives import COUNT_KEY, LOSS_KEY, construct
from twinkle.server.wire import Datum

TASK_KEY = "twinkle_task"
EMBEDDING = "embedding"
TEACHER = ("teacher_topk_logprobs", "teacher_topk_indices")
MARK = "labels"
GKD = "GKDLoss"
IGNORE = -100
SERVER_KEYS = (LOSS_KEY, TASK_KEY, "twinkle_reduction")


def wanted(config: dict[str, Any]) -> bool:
    """Whether the request is one the model runs itself (module docstring)."""
    if TASK_KEY in config:
        return True
    from twinkle.loss.registry import LOSSES

    cls = LOSSES.get(config.get(LOSS_KEY)) if isinstance(config.get(LOSS_KEY), str) else None
    return cls is not None and (config[LOSS_KEY] == GKD or getattr(cls, "consumes", None) == "embeddings")


def build(config: dict[str, Any], forward_only: bool) -> tuple[Any, str]:
    """(the loss the request names, built with its arguments, or None; the task:
    ``causal_lm`` or ``embedding``). ``BadRequest`` names what does not fit."""
    task = config.get(TASK_KEY, "causal_lm")
    if task not in ("causal_lm", EMBEDDING):
        raise BadRequest(f"loss_fn_config[{TASK_KEY!r}] must be 'embedding' or 'causal_lm', got {task!r}")
    if COUNT_KEY in config:
        raise BadRequest(f"loss_fn_config[{COUNT_KEY!r}] is the server's own; leave it out")
    if config.get("twinkle_reduction", "token_mean") != "token_mean":
        raise BadRequest("loss_fn_config['twinkle_reduction']: a twinkle loss is averaged by its own count")
    if "disable_lora" in config:
        raise BadRequest(f"loss_fn_config['disable_lora'] is not read with {config.get(LOSS_KEY) or task}")
    name = config.get(LOSS_KEY)
    if name is None:
        if not (task == EMBEDDING and forward_only):
            raise BadRequest(
                f"loss_fn_config[{TASK_KEY!r}]='{task}' with forward_backward needs {LOSS_KEY!r} "
                "(InfonceLoss); a forward pass without one returns the embeddings"
            )
        extra = sorted(set(config) - set(SERVER_KEYS))
        if extra:
            raise BadRequest(f"loss_fn_config key {extra[0]!r} is not read without {LOSS_KEY!r}")
        return None, task
    loss = construct(name, {k: v for k, v in config.items() if k not in SERVER_KEYS})
    embeds = getattr(loss, "consumes", None) == "embeddings"
    if embeds != (task == EMBEDDING):
        raise BadRequest(
            f"loss_fn_config: {name} trains embeddings; send {TASK_KEY!r}: 'embedding'"
            if embeds
            else f"loss_fn_config[{TASK_KEY!r}]='embedding' needs a loss over embeddings (InfonceLoss), not {name}"
        )
    return loss, task


def _refuse_extra(d: Datum, i: int, reads: tuple[str, ...], who: str) -> None:
    extra = sorted(set(d.inputs) - set(reads))
    if extra:
        raise BadRequest(
            f"datum {i}: loss_fn_inputs {extra[0]!r} is not read by {who} (it reads {', '.join(reads)})"
        )


def check_teacher(data: list[Datum], vocab: int) -> None:
    """Each GKD datum: the shifted datum's inputs (``wire.check_datum``) and the teacher's two
    ``(n, k)`` arrays, one ``k`` for the request, ids in the vocabulary, no NaN or +inf."""
    from twinkle.server.wire import check_datum

    k = None
    for i, d in enumerate(data):
        _refuse_extra(d, i, ("target_tokens", "weights", *TEACHER), GKD)
        plain = Datum(d.tokens, {n: v for n, v in d.inputs.items() if n not in TEACHER})
        check_datum(plain, i, vocab, ("target_tokens", "weights"))
        for name in TEACHER:
            if name not in d.inputs:
                raise BadRequest(
                    f"datum {i}: loss_fn_inputs lacks {name!r} ({GKD} needs {', '.join(TEACHER)})"
                )
            values = d.inputs[name]
            if values.ndim != 2 or values.shape[0] != d.tokens.size:
                raise BadRequest(
                    f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(values.shape)}; send "
                    f"({d.tokens.size}, k): the teacher's top k at each input token"
                )
        logps, ids = d.inputs[TEACHER[0]], d.inputs[TEACHER[1]]
        if logps.dtype.kind != "f" or ids.dtype.kind not in "iu":
            raise BadRequest(f"datum {i}: send {TEACHER[0]!r} as float32 and {TEACHER[1]!r} as int64")
        if logps.shape != ids.shape or (k is not None and logps.shape[1] != k):
            raise BadRequest(
                f"datum {i}: the teacher's arrays are {list(logps.shape)} and {list(ids.shape)}; every datum "
                f"sends both as (n, k) with one k{'' if k is None else f' ({k})'}"
            )
        k = logps.shape[1]
        if np.isnan(logps).any() or (logps > 0).any():
            raise BadRequest(f"datum {i}: {TEACHER[0]!r} holds NaN or a value above 0 (a log-probability)")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise BadRequest(
                f"datum {i}: a teacher token id is outside the vocabulary [0, {vocab}): the teacher has "
                "another tokenizer; distil from a teacher with the student's vocabulary"
            )


def check_embedding(data: list[Datum], vocab: int, marks: bool) -> None:
    """Each embedding datum: tokens in the vocabulary and, with ``marks`` (a loss), ``labels`` of
    one value 0 or 1; nothing else."""
    for i, d in enumerate(data):
        _refuse_extra(d, i, (MARK,), "task 'embedding'")
        if d.tokens.size == 0:
            raise BadRequest(f"datum {i}: model_input has no tokens")
        if int(d.tokens.min()) < 0 or int(d.tokens.max()) >= vocab:
            raise BadRequest(f"datum {i}: a token id is outside the vocabulary [0, {vocab})")
        mark = d.inputs.get(MARK)
        if mark is None and not marks:
            continue
        if mark is None or mark.size != 1 or float(mark.reshape(-1)[0]) not in (0.0, 1.0):
            raise BadRequest(
                f"datum {i}: task 'embedding' needs loss_fn_inputs['labels'], one value: 1 where a group "
                "starts (its anchor), 0 for its positive and negatives"
            )


def teacher_batch(data: list[Datum], pad_id: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the twinkle batch of GKD datums: row ``x + [y[-1]]``, labels ``[-100] + y`` with -100
    where the weight is 0; the teacher's ``(B, L, k)`` tensors in the local layout, position ``i``
    the teacher's distribution of the token after it, which ``GKDLoss.batch_inputs`` takes)."""
    width = max(d.tokens.size for d in data) + 1 if data else 1
    k = data[0].inputs[TEACHER[0]].shape[1] if data else 1
    shape = (len(data), width)
    batch = {
        "input_ids": torch.full(shape, pad_id, dtype=torch.long),
        "labels": torch.full(shape, IGNORE, dtype=torch.long),
        "attention_mask": torch.zeros(shape, dtype=torch.long),
        "position_ids": torch.zeros(shape, dtype=torch.long),
    }
    logps = torch.zeros((*shape, k), dtype=torch.float32)
    ids = torch.zeros((*shape, k), dtype=torch.long)
    for b, d in enumerate(data):
        n = d.tokens.size
        targets = torch.from_numpy(d.inputs["target_tokens"].astype(np.int64))
        weights = torch.from_numpy(d.inputs["weights"].astype(np.float32))
        batch["input_ids"][b, : n + 1] = torch.cat(
            [torch.from_numpy(d.tokens.astype(np.int64)), targets[-1:]]
        )
        batch["labels"][b, 1 : n + 1] = torch.where(weights != 0, targets, IGNORE)
        batch["attention_mask"][b, : n + 1] = 1
        batch["position_ids"][b, : n + 1] = torch.arange(n + 1)
        logps[b, :n] = torch.from_numpy(d.inputs[TEACHER[0]].astype(np.float32))
        ids[b, :n] = torch.from_numpy(d.inputs[TEACHER[1]].astype(np.int64))
    return batch, {TEACHER[0]: logps, TEACHER[1]: ids}


def embedding_rows(data: list[Datum]) -> list[dict[str, Any]]:
    """The local ``task='embedding'`` rows of the datums (``labels``: the mark, when sent)."""
    rows = []
    for d in data:
        row: dict[str, Any] = {"input_ids": d.tokens.astype(np.int64).tolist()}
        if MARK in d.inputs:
            row[MARK] = int(d.inputs[MARK].reshape(-1)[0])
        rows.append(row)
    return rows


def run(
    core: Any, adapter: str, data: list[Datum], loss: Any, task: str, forward_only: bool, window: Any = None
) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
    """The step on ``core`` (a ``ModelCore`` or its proxy); a training call's loss joins
    ``window`` (``objectives.Window``, reported at ``optim_step``)."""
    if task == EMBEDDING:
        outs, total, count = core.run_embedding(adapter, data, loss, forward_only)
    else:
        outs, total, count = core.run_teacher(adapter, data, loss, forward_only)
    if loss is None:
        return outs, {"num_tokens:sum": float(count)}
    if window is not None and not forward_only:
        window.add(loss, total, count, data, [])
    metrics = {"loss:sum": total, "loss:mean": total / max(1, count), "num_tokens:sum": float(count)}
    return outs, metrics
