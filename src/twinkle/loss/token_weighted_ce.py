"""``TokenWeightedCrossEntropyLoss``: each supervised token's cross-entropy times its weight.

The weights come with the batch as ``loss_weights`` (``(batch, seq)`` floats aligned with
``labels``: the weight of the label at position ``t`` scales the loss of predicting it); the
model hands this loss the weights of the supervised rows (``extra_inputs``, see
``twinkle.loss.base``). Use it with ``model.set_loss(TokenWeightedCrossEntropyLoss)``."""

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from twinkle.loss.base import HeadLoss, LossView
from twinkle.loss.cross_entropy import LossOutput, check_reduction, finish, top_is_target
from twinkle.utils.errors import UserError


class TokenWeightedCrossEntropyLoss(HeadLoss):
    """``sum(w_i * CE_i)`` over the supervised tokens (``reduction="sum"``) or that sum divided
    by their count (``mean``; the reported value only, as every ``HeadLoss``). ``weight_key``
    names the batch tensor holding the weights."""

    def __init__(self, reduction: str = "sum", weight_key: str = "loss_weights"):
        self.reduction = check_reduction(reduction)
        self.weight_key = weight_key
        self.extra_inputs = (weight_key,)

    def compute(self, view: LossView) -> LossOutput:
        logits = view.logits
        if view.hidden is not None:
            logits = F.linear(view.hidden, view.weight, view.bias)
        logits = logits.float()
        weights = view.extras[self.weight_key].to(logits.device, torch.float32)
        per_token = F.cross_entropy(logits, view.targets, reduction="none")
        loss_sum = (per_token * weights).sum()
        correct = top_is_target(logits.detach(), view.targets)
        return finish(loss_sum, view.targets.numel(), correct, self.reduction)

    def from_outputs(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> dict:
        raise UserError(
            "TokenWeightedCrossEntropyLoss runs on the model's path only; pass it to model.set_loss"
        )
