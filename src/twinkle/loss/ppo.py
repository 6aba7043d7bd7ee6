"""``PPOLoss``: the clipped surrogate objective of PPO on per-token advantages.

As ``ImportanceSamplingLoss`` (``old_logps`` and ``advantages`` per supervised token), with the
ratio clipped: the loss is ``-sum_t min(ratio_t * A_t, clip(ratio_t, 1 - low, 1 + high) * A_t)``,
the Tinker SDK's ``ppo`` loss (``clip_low_threshold`` / ``clip_high_threshold`` give the bounds
``1 - low`` and ``1 + high`` directly when set as there)."""

import torch

from twinkle.loss.importance_sampling import ImportanceSamplingLoss
from twinkle.utils.errors import UserError


class PPOLoss(ImportanceSamplingLoss):
    """``epsilon_low``/``epsilon_high``: the ratio is clipped to ``[1 - low, 1 + high]``."""

    def __init__(
        self, epsilon_low: float = 0.2, epsilon_high: float = 0.2, reduction: str = "sum", **keys: str
    ):
        super().__init__(reduction=reduction, **keys)
        for name, value in (("epsilon_low", epsilon_low), ("epsilon_high", epsilon_high)):
            if not 0 <= value:
                raise UserError(f"PPOLoss({name}={value}): the clip range must be non-negative")
        self.low, self.high = 1.0 - epsilon_low, 1.0 + epsilon_high

    def objective(self, ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        clipped = ratio.clamp(self.low, self.high)
        return -torch.minimum(ratio * advantages, clipped * advantages)
