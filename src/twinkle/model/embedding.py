"""``task='embedding'``: a causal LM as a sentence encoder, for ``twinkle.loss.InfonceLoss``.

Each row (``input_ids``, and ``labels``: 1 where a group starts, 0 otherwise, a number or a
one-element list as upstream sends it) runs through the model with its output head held back;
the final hidden states (after the final norm) are pooled per row, at the last real token
(``last``, upstream's: a causal model's last position has read the whole text) or as the mean
over the real tokens (``mean``), and L2-normalised, so a dot product is a cosine similarity.
Rows are right-padded into one batch and never packed: a pooled row must see only itself."""

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from twinkle.loss.output import LossOutput
from twinkle.model.forward import causal_lm_of, head_as_identity
from twinkle.model.ulysses import ulysses_of
from twinkle.utils.errors import UserError

TASK = "embedding"


def _mark(row: Mapping[str, Any], i: int, required: bool) -> int:
    value = row.get("labels")
    if value is None and not required:
        return 0
    if torch.is_tensor(value):
        value = value.reshape(-1).tolist()
    if isinstance(value, Sequence) and not isinstance(value, str):
        value = value[0] if len(value) == 1 else None
    if value not in (0, 1):
        raise UserError(
            f"task='embedding': row {i} needs labels 1 (it starts a group: the anchor) or 0 (its positive or "
            f"a negative), got {row.get('labels')!r}"
        )
    return int(value)


def embedding_batch(inputs: Any, pad_id: int, marks: bool = True) -> dict[str, torch.Tensor]:
    """Rows (or an already padded batch with ``(B,)`` marks) -> ``input_ids``, ``attention_mask``,
    ``position_ids`` ``(B, L)`` and ``labels`` ``(B,)``, right-padded. ``marks=False``: rows
    without ``labels`` are embedded only (mark 0)."""
    if isinstance(inputs, Mapping) and torch.is_tensor(inputs.get("input_ids")):
        batch = dict(inputs)
        given = batch.get("labels")
        if given is None and marks:
            raise UserError("task='embedding' needs labels: 1 at each anchor, 0 otherwise")
        rows = batch["input_ids"].shape[0]
        batch["labels"] = (
            torch.zeros(rows, dtype=torch.long) if given is None else torch.as_tensor(given).reshape(-1)
        )
        batch.setdefault("attention_mask", torch.ones_like(batch["input_ids"]))
        batch.setdefault("position_ids", (batch["attention_mask"].cumsum(1) - 1).clamp(min=0))
        return batch
    rows = [inputs] if isinstance(inputs, Mapping) else list(inputs)
    if not rows or not all(isinstance(r, Mapping) and "input_ids" in r for r in rows):
        raise UserError(
            "task='embedding' takes rows with input_ids and labels (1 at each anchor, 0 otherwise)"
        )
    ids = [r["input_ids"].tolist() if torch.is_tensor(r["input_ids"]) else list(r["input_ids"]) for r in rows]
    length = max(len(t) for t in ids)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, tokens in enumerate(ids):
        input_ids[i, : len(tokens)], mask[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long), 1
    marks_ = torch.tensor([_mark(r, i, marks) for i, r in enumerate(rows)])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions, "labels": marks_}


def final_hidden(model: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The last layer's hidden states ``(B, L, H)``, after the final norm, without the head."""
    lm = causal_lm_of(model)
    if ulysses_of(lm) is not None:  # every rank of a group would pool, and count, the same rows
        raise UserError("task='embedding' pools whole sequences and does not run with ulysses_size > 1")
    if "pixel_values" in batch:  # the pooled tokens would include image tokens run without their image
        raise UserError("task='embedding' takes text rows; a row holds images (pixel_values)")
    args = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if head is not None:
        with head_as_identity(head):
            return lm(**args, use_cache=False).logits
    out = lm(**args)
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None:
        raise UserError(f"task='embedding' needs the model's hidden states; {type(lm).__name__} returns none")
    return hidden


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """One L2-normalised fp32 embedding per row (``last`` or ``mean`` over the real tokens)."""
    mask = attention_mask.to(hidden.device)
    if pooling == "mean":
        weights = mask.to(hidden.dtype)[..., None]
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
    else:
        last = (mask.sum(1) - 1).clamp(min=0)
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    return torch.nn.functional.normalize(pooled.float(), dim=-1)


def forms_groups(marks: torch.Tensor) -> bool:
    """Whether the rows' marks (1 at each anchor) split them into groups of two rows or more."""
    marks = torch.as_tensor(marks).reshape(-1).tolist()
    if len(marks) < 2 or marks[0] != 1:
        return False
    starts = [i for i, m in enumerate(marks) if m == 1] + [len(marks)]
    return all(b - a >= 2 for a, b in zip(starts, starts[1:], strict=False))


def embeddings_of(model: Any, batch: Mapping[str, torch.Tensor], pooling: str = "last") -> torch.Tensor:
    return pool(final_hidden(model, batch), batch["attention_mask"], pooling)


def embedding_loss(model: Any, batch: Mapping[str, torch.Tensor], loss: Any) -> LossOutput:
    """The loss of one batch (``loss.from_embeddings``), with the embeddings kept on the output
    (``embeddings``, detached) for the metrics."""
    embeddings = embeddings_of(model, batch, getattr(loss, "pooling", "last"))
    out = loss.from_embeddings(embeddings, batch["labels"])
    out.embeddings = embeddings.detach()
    return out


@torch.no_grad()
def embed_for_eval(model: Any, batch: Mapping[str, torch.Tensor], loss: Any) -> dict[str, Any]:
    """``forward_only(task='embedding')``: ``{"embeddings": (B, D), "loss", "num_tokens"}``; the
    loss when an embedding loss is set and the rows form groups (each anchor followed by its
    positive), else NaN: embedding texts for search (anchors only, say) has no loss to give."""
    pooling = getattr(loss, "pooling", "last")
    embeddings = embeddings_of(model, batch, pooling)
    out = {"embeddings": embeddings, "loss": float("nan"), "num_tokens": 0}
    if hasattr(loss, "from_embeddings") and forms_groups(batch["labels"]):
        result = loss.from_embeddings(embeddings, batch["labels"])
        out["loss"], out["num_tokens"] = float(result.loss), result.num_tokens
    return out
