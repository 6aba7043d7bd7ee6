"""``GRPOAdvantage``: each completion's reward minus its prompt group's mean, optionally scaled."""

from collections.abc import Sequence
from typing import Literal

import torch

from twinkle.advantage.groups import grouped, spread
from twinkle.utils.errors import UserError

SCALES = ("group", "batch", "none")
EPSILON = 1e-8  # keeps an all-equal group's zero advantages zero instead of 0/0


class GRPOAdvantage:
    """``GRPOAdvantage()(rewards, num_generations=G, scale=...)``: for rewards listed prompt by
    prompt, G completions each, ``A_i = r_i - mean(group)``; ``scale='group'`` divides by the
    group's unbiased std (+ 1e-8), ``'batch'`` by the unbiased std of all rewards (+ 1e-8),
    ``'none'`` not at all. An all-equal group has zero advantages, never NaN. Returns a float32
    tensor of one advantage per completion, as ``forward_backward(advantages=...)`` takes it."""

    def __call__(
        self,
        rewards: Sequence[float] | torch.Tensor,
        num_generations: int = 1,
        scale: Literal["group", "batch", "none"] = "group",
    ) -> torch.Tensor:
        if scale not in SCALES:
            raise UserError(f"scale={scale!r} is not one of {', '.join(SCALES)}")
        groups = grouped(rewards, num_generations)
        advantages = groups - groups.mean(dim=-1, keepdim=True)
        if scale == "group":
            advantages = advantages / (spread(groups) + EPSILON)
        elif scale == "batch":
            advantages = advantages / (spread(groups.reshape(1, -1)) + EPSILON)
        return advantages.flatten().to(torch.float32)
