"""The datums of the two objectives the server's model runs itself (``twinkle.server.model_steps``):
distillation (``GKDLoss``: each shifted datum also carries the teacher's top-k) and the embedding
task (``task='embedding'``: one datum per text, its row mark).

The teacher's tensors arrive in the local API's layout, ``(B, L, k)`` with position ``i`` the
teacher's distribution of token ``i + 1`` (``twinkle.loss.gkd``); a row's datum (input tokens
``ids[:n - 1]``) takes positions ``0 .. n - 2``, zero-padded when the tensors are shorter (a
position without a label reads nothing), as the local step pads them."""

from typing import Any

import numpy as np
import torch

from twinkle_client import batches

LOGPS, INDICES = "teacher_topk_logprobs", "teacher_topk_indices"
TASK = {"twinkle_task": "embedding"}


def task_of(task: str | None) -> str:
    """``'causal_lm'`` or ``'embedding'``, the steps the server runs (None: the first)."""
    if task not in (None, "causal_lm", "embedding"):
        raise ValueError(
            f"task={task!r}: over twinkle server a step runs 'causal_lm' (the default) or 'embedding'"
        )
    return task or "causal_lm"


def embeds(loss: Any) -> bool:
    """Whether ``loss`` trains embeddings (``InfonceLoss``)."""
    return getattr(loss, "consumes", None) == "embeddings"


def _teacher_tensor(name: str, value: Any, rows: int, dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.as_tensor(value).to(dtype)
    if tensor.ndim != 3 or tensor.shape[0] != rows:
        raise ValueError(
            f"{name}: shape {tuple(tensor.shape)}; pass ({rows}, length, k), one row per batch row"
        )
    return tensor


def teacher_datums(rows: list[dict[str, list[int]]], logps: Any, indices: Any) -> list[Any]:
    """The rows' shifted datums (``batches.datums_of``) with the teacher's ``(n, k)`` arrays."""
    from tinker import types

    logps = _teacher_tensor(LOGPS, logps, len(rows), torch.float32)
    indices = _teacher_tensor(INDICES, indices, len(rows), torch.int64)
    if logps.shape != indices.shape:
        raise ValueError(
            f"{LOGPS} {tuple(logps.shape)} and {INDICES} {tuple(indices.shape)} must have the same shape"
        )
    data = batches.datums_of(rows)
    for b, (row, datum) in enumerate(zip(rows, data, strict=True)):
        n = len(row["input_ids"]) - 1
        for name, tensor in ((LOGPS, logps), (INDICES, indices)):
            part = tensor.new_zeros((n, tensor.shape[2]))
            have = min(n, tensor.shape[1])
            part[:have] = tensor[b, :have]
            datum.loss_fn_inputs[name] = types.TensorData.from_numpy(np.ascontiguousarray(part.numpy()))
    return data


def step_datums(loss_name: str, rows: list[dict], values: dict, logps: Any, indices: Any) -> list[Any]:
    """A causal step's datums: the teacher's with ``GKDLoss`` (which needs it), else the rows'
    with the step's ``values`` (``batches.datums_of``); a teacher another loss would not read is
    a ``ValueError``."""
    if loss_name == "GKDLoss":
        if logps is None or indices is None:
            raise ValueError("GKDLoss needs the teacher: teacher_topk_logprobs= and teacher_topk_indices=")
        return teacher_datums(rows, logps, indices)
    if logps is not None or indices is not None:
        raise ValueError(f"{loss_name} does not read the teacher's top-k; set_loss('GKDLoss', ...)")
    return batches.datums_of(rows, values)


def embedding_datums(inputs: Any, marks: bool) -> tuple[list[Any], torch.Tensor]:
    """(one datum per row: its tokens and ``labels``, its mark; the marks ``(B,)``), the rows
    read as the local ``task='embedding'`` reads them (``marks=False``: a row without labels is
    mark 0, embedded only)."""
    from tinker import types

    from twinkle.model.embedding import embedding_batch
    from twinkle.utils.errors import UserError

    try:
        batch = embedding_batch(inputs, 0, marks=marks)
    except UserError as exc:
        raise ValueError(str(exc)) from None
    data = []
    for b in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][b].sum())
        mark = np.asarray([int(batch["labels"][b])], dtype=np.int64)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(batch["input_ids"][b, :n].tolist()),
                loss_fn_inputs={"labels": types.TensorData.from_numpy(mark)},
            )
        )
    return data, batch["labels"].reshape(-1)


def embeddings_of(out: Any) -> torch.Tensor:
    """The ``(B, D)`` embeddings of a forward(_backward) answer, one datum per row."""
    return torch.stack(
        [torch.as_tensor(np.asarray(o["embeddings"].tolist(), dtype=np.float32)) for o in out.loss_fn_outputs]
    )
