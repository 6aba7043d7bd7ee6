"""``outputs_loss``: a loss of upstream's convention (``loss(inputs, outputs)``) run on a
``positions`` view, its result turned into a ``LossOutput``."""

from collections.abc import Mapping
from typing import Any

import torch

from twinkle.loss.base import Loss, LossView
from twinkle.loss.cross_entropy import IGNORE_INDEX, LossOutput, top_is_target
from twinkle.utils.errors import UserError


def outputs_loss(loss_fn: Loss, view: LossView) -> LossOutput:
    """``loss_fn(inputs, outputs)``: ``inputs`` is the batch with each position's target as
    ``labels`` (-100 where none); ``outputs`` holds ``logps`` (unless ``loss_fn.require_logps``
    is False) and ``logits`` (if ``loss_fn.require_logits``), in fp32. A result with a non-zero
    ``num_tokens`` is a sum over that many tokens; otherwise (a bare scalar, or ``num_tokens``
    0) it is a mean over the supervised tokens, and its sum is the mean times their count, so
    training still takes the mean over every supervised token of the global batch."""
    targets, logits = view.targets, view.logits
    mask = targets != IGNORE_INDEX
    outputs: dict[str, Any] = {"logits": logits if loss_fn.require_logits else None}
    if loss_fn.require_logps:
        outputs["logps"] = view.logps
    result = loss_fn({**view.batch, "labels": targets}, outputs)
    loss = result.get("loss") if isinstance(result, Mapping) else result
    if not (torch.is_tensor(loss) and loss.numel() == 1):
        raise UserError(
            f"the loss {loss_fn.name} returned {type(result).__name__}; "
            "return a scalar tensor or {'loss': scalar tensor, 'num_tokens': ...}"
        )
    loss = loss.reshape(()).float()
    supervised = int(mask.sum())
    counted = result.get("num_tokens") if isinstance(result, Mapping) else None
    if counted is not None and int(counted) != 0:
        num_tokens, loss_sum = (int(counted) if supervised else 0), loss
    else:
        num_tokens, loss_sum = supervised, loss * supervised
    correct = top_is_target(logits[mask].detach(), targets[mask])
    return LossOutput(loss=loss, loss_sum=loss_sum, num_tokens=num_tokens, num_correct=correct)
