"""``RLOOAdvantage``: each completion's reward minus the mean of the others of its group."""

from collections.abc import Sequence

import torch

from twinkle.advantage.groups import grouped
from twinkle.utils.errors import UserError


class RLOOAdvantage:
    """REINFORCE leave-one-out: ``A_i = r_i - mean(r_j, j != i)`` within each prompt's group of
    ``num_generations`` (at least 2) completions, which equals ``G / (G - 1) * (r_i - mean)``.
    Returns a float32 tensor of one advantage per completion."""

    def __call__(self, rewards: Sequence[float] | torch.Tensor, num_generations: int = 2) -> torch.Tensor:
        groups = grouped(rewards, num_generations)
        if num_generations < 2:
            raise UserError(
                "RLOOAdvantage needs num_generations >= 2 (the baseline is the other completions)"
            )
        others = (groups.sum(dim=-1, keepdim=True) - groups) / (num_generations - 1)
        return (groups - others).flatten().to(torch.float32)
