"""A distillation teacher in the trainer's process: its top-k log-probabilities on the student's
rows, for ``twinkle.loss.GKDLoss``.

``teacher_topk(teacher, rows, k)`` scores the rows with ``twinkle.model.scoring_topk``: one
inference-only forward of the rows packed end to end (no padding, a shared prompt prefix once),
the output head only at the positions whose next token is supervised (the completion), so the
``(rows, length, vocab)`` logits are never built: on a prompt-heavy batch most of a plain
forward's head product and top-k would be thrown away. ``TeacherCache`` keeps each
row's values by its tokens, so off-policy distillation (the dataset's own completions, the same
rows every epoch) scores each row once. A teacher with another tokenizer cannot be distilled
token by token; ``check_same_vocabulary`` says so in one line."""

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from twinkle.loss.gkd import INDICES, LOGPS
from twinkle.model.forward import causal_lm_of
from twinkle.model.scoring_topk import topk_at_targets
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError


def _module(teacher: Any) -> Any:
    """The causal LM of a ``TransformersModel``, a PEFT model or a plain HF model."""
    return causal_lm_of(teacher if isinstance(teacher, torch.nn.Module) else teacher.model)


def check_same_vocabulary(student_tokenizer: Any, teacher_tokenizer: Any) -> None:
    """One line unless both tokenizers map the same strings to the same ids."""
    if student_tokenizer.get_vocab() != teacher_tokenizer.get_vocab():
        raise UserError(
            f"the teacher's tokenizer ({len(teacher_tokenizer)} tokens) is not the student's "
            f"({len(student_tokenizer)} tokens): GKD compares distributions token by token; distil from a "
            "teacher of the same tokenizer"
        )


def _ids(row: Mapping[str, Any], key: str) -> list[int]:
    value = row[key]
    return value.tolist() if torch.is_tensor(value) else list(value)


def padded(rows: Sequence[Mapping[str, Any]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, targets)`` of right-padded rows; ``targets[i]`` is the label
    of token ``i + 1`` (-100 where none)."""
    length = max(len(row["input_ids"]) for row in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    targets = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens, labels = _ids(row, "input_ids"), _ids(row, "labels")
        ids[i, : len(tokens)], mask[i, : len(tokens)] = torch.tensor(tokens), 1
        targets[i, : len(labels) - 1] = torch.tensor(labels[1:])
    return ids, mask, targets


@torch.no_grad()
def teacher_topk(
    teacher: Any, rows: Sequence[Mapping[str, Any]], k: int, pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """The teacher's ``k`` most likely tokens and their log-probabilities at each supervised
    position of ``rows`` (each with ``input_ids`` and ``labels``), as ``GKDLoss`` takes them:
    ``{teacher_topk_logprobs, teacher_topk_indices}`` ``(B, L, k)``, position ``i`` scoring token
    ``i + 1``, zero where no token is supervised."""
    lm = _module(teacher)
    head = lm.get_output_embeddings()
    vocab = int(head.weight.shape[0])
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
        raise UserError(
            f"top-k must be a whole number from 1 to the teacher's vocabulary ({vocab}), got {k!r}"
        )
    device = next(lm.parameters()).device
    ids, mask, targets = (t.to(device) for t in padded(rows, pad_id))
    where = targets != IGNORE_INDEX
    # labels aligned with the inputs, as a training batch holds them: position i's target is i + 1's
    labels = torch.cat([torch.full_like(targets[:, :1], IGNORE_INDEX), targets[:, :-1]], dim=1)
    was_training = lm.training
    lm.eval()
    try:
        scores = topk_at_targets(lm, {"input_ids": ids, "attention_mask": mask, "labels": labels}, k)
    finally:
        lm.train(was_training)
    logps = torch.zeros((*ids.shape, k), device=device)
    index = torch.zeros((*ids.shape, k), dtype=torch.long, device=device)
    logps[where], index[where] = scores.values, scores.indices
    return {LOGPS: logps.cpu(), INDICES: index.cpu()}


class TeacherCache:
    """``teacher_topk`` per row, kept by the row's tokens: ``inputs(rows)`` scores only the rows
    it has not seen and returns the batch's tensors. ``scored`` counts the rows scored."""

    def __init__(self, teacher: Any, k: int, pad_id: int = 0):
        self.teacher, self.k, self.pad_id = teacher, k, pad_id
        self.rows: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.scored = 0

    @staticmethod
    def key(row: Mapping[str, Any]) -> tuple[int, ...]:
        return tuple(_ids(row, "input_ids")) + (-1,) + tuple(_ids(row, "labels"))

    def inputs(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        new = [row for row in rows if self.key(row) not in self.rows]
        if new:
            out = teacher_topk(self.teacher, new, self.k, self.pad_id)
            for i, row in enumerate(new):
                n = len(row["input_ids"])
                self.rows[self.key(row)] = (out[LOGPS][i, :n].clone(), out[INDICES][i, :n].clone())
            self.scored += len(new)
        length = max(len(row["input_ids"]) for row in rows)
        logps = torch.zeros((len(rows), length, self.k))
        index = torch.zeros((len(rows), length, self.k), dtype=torch.long)
        for i, row in enumerate(rows):
            lp, ix = self.rows[self.key(row)]
            logps[i, : lp.shape[0]], index[i, : ix.shape[0]] = lp, ix
        return {LOGPS: logps, INDICES: index}
