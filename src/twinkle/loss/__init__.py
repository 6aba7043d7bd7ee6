"""Token losses over supervised positions, and upstream's loss classes.

The protocol every loss follows is in ``twinkle.loss.base``. Public names: ``Loss``, ``HeadLoss``,
``LossView``, ``UpstreamLoss``, ``as_loss``, ``CrossEntropyLoss``, ``ChunkedCrossEntropyLoss``,
``FusedLinearCrossEntropyLoss``, ``LigerFusedLinearCrossEntropyLoss``, ``MSELoss``, ``LOSSES``,
``build_loss``, ``resolve_loss``, ``LossOutput``, ``fused_linear_cross_entropy``, and the preference
losses ``DPOLoss``, ``SimPOLoss``, ``CPOLoss``, ``ORPOLoss``, ``PreferenceLoss``, and the policy
losses over sampled completions ``GRPOLoss``, ``GSPOLoss``, ``DRGRPOLoss``, ``CISPOLoss``, ``BNPOLoss``,
``SAPOLoss``; ``GKDLoss`` (distillation from a teacher) and ``InfonceLoss`` (embeddings);
``torch_loss_mapping`` (upstream's short names)."""

from twinkle.loss.base import HeadLoss, Loss, LossView, UpstreamLoss, as_loss
from twinkle.loss.chunked_cross_entropy import ChunkedCrossEntropyLoss
from twinkle.loss.cross_entropy import CrossEntropyLoss, LossOutput
from twinkle.loss.dpo import DPOLoss
from twinkle.loss.fused_linear_ce import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from twinkle.loss.gkd import GKDLoss
from twinkle.loss.grpo import BNPOLoss, CISPOLoss, DRGRPOLoss, GRPOLoss, GSPOLoss
from twinkle.loss.infonce import InfonceLoss
from twinkle.loss.liger_fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
from twinkle.loss.mse import MSELoss
from twinkle.loss.preference import CPOLoss, ORPOLoss, PreferenceLoss, SimPOLoss
from twinkle.loss.registry import LOSSES, build_loss, resolve_loss, torch_loss_mapping
from twinkle.loss.sapo import SAPOLoss

__all__ = [
    "Loss",
    "HeadLoss",
    "LossView",
    "UpstreamLoss",
    "as_loss",
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
    "DPOLoss",
    "SimPOLoss",
    "CPOLoss",
    "ORPOLoss",
    "PreferenceLoss",
    "GRPOLoss",
    "GSPOLoss",
    "DRGRPOLoss",
    "CISPOLoss",
    "BNPOLoss",
    "SAPOLoss",
    "GKDLoss",
    "InfonceLoss",
    "torch_loss_mapping",
]
