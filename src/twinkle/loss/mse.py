"""``MSELoss``: mean squared error between the model's logits and float labels (regression heads)."""

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from twinkle.loss.base import Loss
from twinkle.utils.errors import UserError


class MSELoss(Loss):
    """``mean((outputs["logits"] - inputs["labels"]) ** 2)``, upstream's convention (no token
    count: the value is a mean). The logits must have the labels' shape: a reward or value head,
    not a language model's ``(batch, seq, vocab)`` logits."""

    require_logits = True
    require_logps = False

    def __call__(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> dict:
        preds, labels = outputs.get("logits"), inputs["labels"]
        if preds is None:
            raise UserError("MSELoss needs outputs['logits']; pass the model's predictions there")
        if tuple(preds.shape) != tuple(labels.shape):
            raise UserError(
                f"MSELoss: logits {tuple(preds.shape)} and labels {tuple(labels.shape)} differ in shape; "
                "it needs a model whose logits match its labels (a regression head), not a language model's"
            )
        return {"loss": F.mse_loss(preds.float(), labels.to(torch.float32))}
