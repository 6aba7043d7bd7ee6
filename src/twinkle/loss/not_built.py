"""Upstream's losses that Twinkle does not compute yet, importable by name so that a script
written against upstream gets past its imports and stops, with one line, where it builds one."""

from typing import Any

from twinkle.loss.base import Loss
from twinkle.utils.errors import UserError


class _NotBuilt(Loss):
    what = ""

    def __init__(self, *args: Any, **kwargs: Any):
        raise UserError(f"{type(self).__name__}: not supported yet: {self.what}")


class GKDLoss(_NotBuilt):
    """Generalized knowledge distillation (a teacher's token distributions): not built yet."""

    what = "knowledge distillation from a teacher model's logits"


class InfonceLoss(_NotBuilt):
    """A contrastive loss over embeddings (InfoNCE): not built yet."""

    what = "contrastive (InfoNCE) training of embedding models"
