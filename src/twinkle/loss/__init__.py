"""Token losses over supervised positions: ``CrossEntropyLoss`` and ``FusedLinearCrossEntropyLoss``.

Public names: ``LOSSES``, ``build_loss``, ``CrossEntropyLoss``, ``FusedLinearCrossEntropyLoss``,
``LossOutput``, ``fused_linear_cross_entropy``."""

from twinkle.loss.cross_entropy import CrossEntropyLoss, LossOutput
from twinkle.loss.fused_linear_ce import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from twinkle.loss.registry import LOSSES, build_loss

__all__ = [
    "LOSSES",
    "build_loss",
    "CrossEntropyLoss",
    "FusedLinearCrossEntropyLoss",
    "LossOutput",
    "fused_linear_cross_entropy",
]
