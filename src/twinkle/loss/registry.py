"""Loss names accepted by ``model.set_loss``."""

from typing import Any

from twinkle.loss.cross_entropy import CrossEntropyLoss
from twinkle.loss.fused_linear_ce import FusedLinearCrossEntropyLoss
from twinkle.utils.errors import UserError

# 'LigerFusedLinearCrossEntropyLoss' is the name upstream scripts use; it maps to our chunked
# implementation, which runs on every device (Liger's Triton kernel needs CUDA).
LOSSES: dict[str, type] = {
    "CrossEntropyLoss": CrossEntropyLoss,
    "FusedLinearCrossEntropyLoss": FusedLinearCrossEntropyLoss,
    "LigerFusedLinearCrossEntropyLoss": FusedLinearCrossEntropyLoss,
}


def build_loss(name: str, **kwargs: Any):
    if name not in LOSSES:
        raise UserError(f"unknown loss {name!r}; valid names: {', '.join(LOSSES)}")
    try:
        return LOSSES[name](**kwargs)
    except (TypeError, ValueError) as exc:
        raise UserError(f"loss {name}: {exc}") from exc
