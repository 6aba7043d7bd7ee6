"""``TokenWeightedCrossEntropyLoss``: each supervised token's cross-entropy times its weight.

The weights come with the batch as ``loss_weights`` (``(batch, seq)`` floats aligned with
``labels``: the weight of the label at position ``t`` scales the loss of predicting it); the
model hands this loss the weights of the supervised rows (``extra_inputs``, see
``twinkle.loss.base``). Use it with ``model.set_loss(TokenWeightedCrossEntropyLoss)``."""

import torch

from twinkle.loss.base import HeadLoss, LossView
from twinkle.loss.cross_entropy import LossOutput, check_reduction, finish, top_is_target
from twinkle.loss.importance_sampling import token_logps


class TokenWeightedCrossEntropyLoss(HeadLoss):
    """``sum(w_i * CE_i)`` over the supervised tokens (``reduction="sum"``) or that sum divided
    by their count (``mean``; the reported value only, as every ``HeadLoss``). ``weight_key``
    names the batch tensor holding the weights."""

    def __init__(self, reduction: str = "sum", weight_key: str = "loss_weights"):
        self.reduction = check_reduction(reduction)
        self.weight_key = weight_key
        self.extra_inputs = (weight_key,)

    def compute(self, view: LossView) -> LossOutput:
        logits, logps = token_logps(view, self.name)
        weights = view.extras[self.weight_key].to(logits.device, torch.float32)
        loss_sum = (-logps * weights).sum()
        correct = top_is_target(logits.detach(), view.targets)
        return finish(loss_sum, view.targets.numel(), correct, self.reduction)
