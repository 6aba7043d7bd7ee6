"""Token losses over supervised positions, and upstream's loss classes.

Public names: ``Loss``, ``HeadLoss``, ``CrossEntropyLoss``, ``ChunkedCrossEntropyLoss``,
``FusedLinearCrossEntropyLoss``, ``LigerFusedLinearCrossEntropyLoss``, ``MSELoss``, ``LOSSES``,
``build_loss``, ``resolve_loss``, ``LossOutput``, ``fused_linear_cross_entropy``."""

from twinkle.loss.base import HeadLoss, Loss
from twinkle.loss.chunked_cross_entropy import ChunkedCrossEntropyLoss
from twinkle.loss.cross_entropy import CrossEntropyLoss, LossOutput
from twinkle.loss.fused_linear_ce import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from twinkle.loss.liger_fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
from twinkle.loss.mse import MSELoss
from twinkle.loss.registry import LOSSES, build_loss, resolve_loss

__all__ = [
    "Loss",
    "HeadLoss",
    "CrossEntropyLoss",
    "ChunkedCrossEntropyLoss",
    "FusedLinearCrossEntropyLoss",
    "LigerFusedLinearCrossEntropyLoss",
    "MSELoss",
    "LOSSES",
    "build_loss",
    "resolve_loss",
    "LossOutput",
    "fused_linear_cross_entropy",
]
