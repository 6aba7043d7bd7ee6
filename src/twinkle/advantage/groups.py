"""Rewards as ``(prompts, num_generations)`` groups: completions of one prompt are consecutive."""

from collections.abc import Sequence

import torch

from twinkle.utils.errors import UserError


def grouped(rewards: Sequence[float] | torch.Tensor, num_generations: int) -> torch.Tensor:
    """``rewards`` (a ``(N, k)`` tensor summed over ``k``) as a float64 ``(groups,
    num_generations)`` tensor; ``UserError`` when they do not
    split into whole groups or hold a NaN/inf (a reward function's bug would otherwise become a
    NaN step)."""
    values = torch.as_tensor(rewards, dtype=torch.float64)
    if values.dim() == 2:  # several rewards per completion: their sum, as upstream
        values = values.sum(dim=-1)
    values = values.flatten()
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 1:
        raise UserError(f"num_generations must be a positive integer, got {num_generations!r}")
    if values.numel() == 0 or values.numel() % num_generations:
        raise UserError(
            f"{values.numel()} rewards do not split into groups of num_generations={num_generations}; "
            "give one reward per completion, num_generations completions per prompt, in prompt order"
        )
    bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
    if bad:
        raise UserError(
            f"reward {bad[0]} is {values[bad[0]].item()}; a reward function must return finite numbers"
        )
    return values.view(-1, num_generations)


def spread(values: torch.Tensor) -> torch.Tensor:
    """The unbiased standard deviation along the last dimension (n - 1 in the denominator, as
    TRL's GRPO uses), 0 where there is a single value."""
    if values.shape[-1] < 2:
        return torch.zeros(values.shape[:-1] + (1,), dtype=values.dtype)
    return values.std(dim=-1, keepdim=True)
