"""``ChunkedCrossEntropyLoss``: cross-entropy over ``chunk_size`` rows of logits at a time.

On the model's path it is the fused linear cross-entropy (``twinkle.loss.fused_linear_ce``) with
chunks of ``chunk_size`` rows: the head's logits exist one chunk at a time. With ``dft`` (which
the fused kernel does not compute) and on logits it is given, each chunk's softmax runs under
activation checkpointing, so backward recomputes it instead of keeping every chunk's."""

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from twinkle.loss.base import HeadLoss, LossView
from twinkle.loss.cross_entropy import (
    IGNORE_INDEX,
    LossOutput,
    check_reduction,
    dft_loss_sum,
    drop_ignored,
    finish,
    logps_output,
    top_is_target,
)
from twinkle.loss.fused_linear_ce import fused_linear_cross_entropy
from twinkle.utils.errors import UserError


def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor, dft: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    loss = dft_loss_sum(logits, targets) if dft else F.cross_entropy(logits, targets, reduction="sum")
    return loss, top_is_target(logits.detach(), targets)


def _head_chunk_loss(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, dft: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _chunk_loss(F.linear(hidden, weight, bias), targets, dft)


class ChunkedCrossEntropyLoss(HeadLoss):
    """Upstream's constructor: ``chunk_size`` (rows of logits per chunk), ``ignore_index``,
    ``reduction`` (``mean`` or ``sum``) and ``dft``, as ``CrossEntropyLoss``; the same loss,
    with less memory."""

    require_logits = True
    require_logps = False

    def __init__(
        self,
        chunk_size: int = 1024,
        ignore_index: int = IGNORE_INDEX,
        reduction: str = "mean",
        dft: bool = False,
    ):
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise UserError(
                f"ChunkedCrossEntropyLoss: chunk_size must be a positive integer, got {chunk_size!r}"
            )
        self.chunk_size = chunk_size
        self.ignore_index = ignore_index
        self.reduction = check_reduction(reduction)
        self.dft = bool(dft)

    def compute(self, view: LossView) -> LossOutput:
        if view.hidden is not None:
            return self._from_head(view.hidden, view.weight, view.bias, view.targets)
        if view.logits is None:
            return logps_output(view, self.ignore_index, self.reduction, self.dft)
        logits, targets = drop_ignored(view.logits, view.targets, self.ignore_index)
        return self._chunked(
            lambda a, b: checkpoint(_chunk_loss, logits[a:b], targets[a:b], self.dft, use_reentrant=False),
            logits,
            logits,
            targets,
        )

    def _from_head(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
    ) -> LossOutput:
        hidden, targets = drop_ignored(hidden, targets, self.ignore_index)
        if not self.dft:
            loss_sum, correct = fused_linear_cross_entropy(hidden, weight, targets, bias, self.chunk_size)
            return finish(loss_sum, targets.numel(), correct, self.reduction)
        return self._chunked(
            lambda a, b: checkpoint(
                _head_chunk_loss, hidden[a:b], weight, bias, targets[a:b], True, use_reentrant=False
            ),
            hidden,
            weight,
            targets,
        )

    def _chunked(self, run: Any, rows: torch.Tensor, like: torch.Tensor, targets: torch.Tensor) -> LossOutput:
        # an empty chunk list still gives a loss connected to the inputs (zero gradients)
        loss_sum = (rows.sum() * 0 + like.sum() * 0).float()
        correct = torch.zeros((), dtype=torch.long, device=rows.device)
        for start in range(0, rows.shape[0], self.chunk_size):
            loss, right = run(start, start + self.chunk_size)
            loss_sum = loss_sum + loss
            correct = correct + right
        return finish(loss_sum, targets.numel(), correct, self.reduction)
