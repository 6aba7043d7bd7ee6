"""``RLOOAdvantage``: each completion's reward minus the mean of the others of its group."""

from collections.abc import Sequence

import torch

from twinkle.advantage.base import SCALES, Advantage, Scale
from twinkle.advantage.groups import grouped, spread
from twinkle.utils.errors import UserError

EPSILON = 1e-8


class RLOOAdvantage(Advantage):
    """REINFORCE leave-one-out: ``A_i = r_i - mean(r_j, j != i)`` within each prompt's group of
    ``num_generations`` (at least 2) completions, which equals ``G / (G - 1) * (r_i - mean)``.
    ``scale`` as ``GRPOAdvantage``'s: ``'group'`` divides by the group's unbiased std (+ 1e-8),
    ``'batch'`` by that of all rewards, ``'none'`` not at all (plain RLOO).
    Returns a float32 tensor of one advantage per completion."""

    def __call__(
        self, rewards: Sequence[float] | torch.Tensor, num_generations: int = 2, scale: Scale = "group"
    ) -> torch.Tensor:
        if scale not in SCALES:
            raise UserError(f"scale={scale!r} is not one of {', '.join(SCALES)}")
        groups = grouped(rewards, num_generations)
        if num_generations < 2:
            raise UserError(
                "RLOOAdvantage needs num_generations >= 2 (the baseline is the other completions)"
            )
        others = (groups.sum(dim=-1, keepdim=True) - groups) / (num_generations - 1)
        advantages = groups - others
        if scale == "group":
            advantages = advantages / (spread(groups) + EPSILON)
        elif scale == "batch":
            advantages = advantages / (spread(groups.reshape(1, -1)) + EPSILON)
        return advantages.flatten().to(torch.float32)
