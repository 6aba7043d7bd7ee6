"""``Advantage``: the call every advantage takes, ``adv(rewards, num_generations=, scale=)``."""

from collections.abc import Sequence
from typing import Literal

import torch

Scale = Literal["group", "batch", "none"]
SCALES = ("group", "batch", "none")


class Advantage:
    """Base of the advantages: ``__call__(rewards, num_generations=1, scale='group')`` returns a
    float32 tensor of one advantage per completion (``.tolist()`` for the step). ``rewards`` are
    listed prompt by prompt, ``num_generations`` completions each; a ``(N, k)`` tensor of several
    rewards per completion is summed over ``k``."""

    def __call__(
        self, rewards: Sequence[float] | torch.Tensor, num_generations: int = 1, scale: Scale = "group"
    ) -> torch.Tensor:
        raise NotImplementedError(
            f"{type(self).__name__} must implement __call__(rewards, num_generations, scale)"
        )
