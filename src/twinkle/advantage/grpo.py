"""``GRPOAdvantage``: each completion's reward minus its prompt group's mean, optionally scaled."""

from collections.abc import Sequence

import torch

from twinkle.advantage.base import SCALES, Advantage, Scale
from twinkle.advantage.groups import grouped, spread
from twinkle.utils.errors import UserError

EPSILON = 1e-8  # keeps an all-equal group's zero advantages zero instead of 0/0


class GRPOAdvantage(Advantage):
    """``GRPOAdvantage()(rewards, num_generations=G, scale=...)``: for rewards listed prompt by
    prompt, G completions each, ``A_i = r_i - mean(group)``; ``scale='group'`` divides by the
    group's unbiased std (+ 1e-8), ``'batch'`` by the unbiased std of all rewards (+ 1e-8),
    ``'none'`` not at all. An all-equal group has zero advantages, never NaN.

    With ``G = 1`` there is no group to compare with, so (as upstream) the batch is the baseline:
    ``'none'`` gives ``r_i - mean(batch)``, ``'batch'`` that over the batch's std, and
    ``'group'`` the rewards unchanged (a group of one has no mean to subtract that would leave a
    signal). Returns a float32 tensor of one advantage per completion, as
    ``forward_backward(advantages=...)`` takes it."""

    def __call__(
        self, rewards: Sequence[float] | torch.Tensor, num_generations: int = 1, scale: Scale = "group"
    ) -> torch.Tensor:
        if scale not in SCALES:
            raise UserError(f"scale={scale!r} is not one of {', '.join(SCALES)}")
        groups = grouped(rewards, num_generations)
        if num_generations == 1:
            if scale == "group":
                return groups.flatten().to(torch.float32)
            groups = groups.reshape(1, -1)  # the batch as one group
        advantages = groups - groups.mean(dim=-1, keepdim=True)
        if scale == "group":
            advantages = advantages / (spread(groups) + EPSILON)
        elif scale == "batch":
            advantages = advantages / (spread(groups.reshape(1, -1)) + EPSILON)
        return advantages.flatten().to(torch.float32)
