"""Cross-entropy on supervised positions only: ``CrossEntropyLoss`` and the helpers every token
loss shares.

On the model's path a loss takes the final hidden states of the positions whose next token is
supervised (``(N, hidden)``), the head weight (``(vocab, hidden)``) and the targets (``(N,)``).
Positions whose label is -100 (prompts, padding) never reach the head: in SFT they are most of
the tokens, and their logits would be computed only to be thrown away. Called as
``loss(inputs, outputs)`` (upstream's convention, see ``twinkle.loss.base``), the same losses
read ``outputs["logps"]`` or ``outputs["logits"]`` instead."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from twinkle.loss.base import HeadLoss
from twinkle.loss.head import head_logits
from twinkle.utils.errors import UserError

IGNORE_INDEX = -100
REDUCTIONS = ("sum", "mean")


@dataclass
class LossOutput:
    """``loss`` as the loss function reports it (``reduction``); ``loss_sum`` is always the
    summed token loss the trainer normalises by the global token count."""

    loss: torch.Tensor
    loss_sum: torch.Tensor
    num_tokens: int
    num_correct: torch.Tensor


def check_reduction(reduction: str) -> str:
    if reduction not in REDUCTIONS:
        raise UserError(f"reduction={reduction!r} is not supported; use one of {', '.join(REDUCTIONS)}")
    return reduction


def finish(loss_sum: torch.Tensor, num_tokens: int, num_correct: torch.Tensor, reduction: str) -> LossOutput:
    loss = loss_sum if reduction == "sum" else loss_sum / max(1, num_tokens)
    return LossOutput(loss=loss, loss_sum=loss_sum, num_tokens=num_tokens, num_correct=num_correct)


def top_is_target(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """How many rows' target logit is the row's maximum (the accuracy metric's count; a tie at
    the top counts, where ``argmax`` would pick the first; the fused loss counts the same way)."""
    return (logits.gather(1, targets[:, None]).squeeze(1) == logits.amax(dim=-1)).sum()


def drop_ignored(
    rows: torch.Tensor, targets: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows whose target is not ``ignore_index``. The model never passes a -100 target, so
    with the default ``ignore_index`` this is the identity (no copy)."""
    if ignore_index == IGNORE_INDEX:
        return rows, targets
    keep = targets != ignore_index
    return rows[keep], targets[keep]


def dft_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Dynamic fine-tuning (arXiv 2508.05629): each token's ``-log p`` weighted by its own
    probability ``p``, taken as a constant (the paper's stop-gradient), summed."""
    logp = -F.cross_entropy(logits, targets, reduction="none")
    return (-(logp.detach().exp()) * logp).sum()


def target_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)`` at each position's label (fp32; an ignored label reads index 0)."""
    logps = torch.log_softmax(logits.float(), dim=-1)
    return logps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def ce_from_outputs(
    inputs: Mapping[str, Any], outputs: Mapping[str, Any], ignore_index: int, reduction: str, dft: bool
) -> dict[str, Any]:
    """Upstream's convention: ``{"loss", "num_tokens"}`` from ``outputs["logps"]`` (or
    ``outputs["logits"]``) and the shifted ``inputs["labels"]`` (-100 and ``ignore_index`` are
    left out). A summed loss reports its token count (at least 1); a mean reports
    ``num_tokens`` 0, as upstream's losses do."""
    labels = inputs["labels"]
    logps = outputs.get("logps")
    if logps is None:
        if outputs.get("logits") is None:
            raise UserError(
                "a cross-entropy loss needs outputs['logps'] or outputs['logits']; pass one of them"
            )
        logps = target_logps(outputs["logits"], labels)
    mask = (labels != ignore_index) & (labels != IGNORE_INDEX)
    per_token = -(logps.detach().exp()) * logps if dft else -logps
    total = torch.where(mask, per_token, torch.zeros_like(per_token)).sum()
    count = mask.sum()
    if reduction == "sum":
        return {"loss": total, "num_tokens": count.clamp(min=1)}
    return {"loss": total / count.clamp(min=1), "num_tokens": 0}


class CrossEntropyLoss(HeadLoss):
    """Materialise the logits of the supervised positions, then ``F.cross_entropy`` in fp32.

    Upstream's constructor: ``ignore_index`` (a label left out of the loss besides -100, which
    the model never scores), ``reduction`` (``mean`` or ``sum``: the reported value only, see
    ``HeadLoss``) and ``dft`` (``dft_loss_sum``). The model's default loss is this class with
    ``reduction="sum"``."""

    def __init__(self, ignore_index: int = IGNORE_INDEX, reduction: str = "mean", dft: bool = False):
        self.ignore_index = ignore_index
        self.reduction = check_reduction(reduction)
        self.dft = bool(dft)

    def head_loss(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> LossOutput:
        hidden, targets = drop_ignored(hidden, targets, self.ignore_index)
        return self._loss(head_logits(hidden, weight, bias).float(), targets)

    def logits_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> LossOutput:
        return self._loss(*drop_ignored(logits, targets, self.ignore_index))

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> LossOutput:
        if self.dft:
            loss_sum = dft_loss_sum(logits, targets)
        else:
            loss_sum = F.cross_entropy(logits, targets, reduction="sum")
        num_correct = top_is_target(logits.detach(), targets)
        return finish(loss_sum, targets.numel(), num_correct, self.reduction)

    def from_outputs(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> dict:
        return ce_from_outputs(inputs, outputs, self.ignore_index, self.reduction, self.dft)
