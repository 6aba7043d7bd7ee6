"""What every loss returns and the label conventions every loss shares: ``LossOutput``,
``IGNORE_INDEX`` (a position with no target) and ``top_is_target`` (the accuracy metric's count).

The lowest module of ``twinkle.loss``: the protocol (``twinkle.loss.base``) and every loss import
it, and it imports no other module of the package."""

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass
class LossOutput:
    """``loss`` as the loss function reports it (``reduction``); ``loss_sum`` is always the
    summed token loss the trainer normalises by the global token count."""

    loss: torch.Tensor
    loss_sum: torch.Tensor
    num_tokens: int
    num_correct: torch.Tensor


def top_is_target(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """How many rows' target logit is the row's maximum (the accuracy metric's count; a tie at
    the top counts, where ``argmax`` would pick the first; the fused loss counts the same way)."""
    return (logits.gather(1, targets[:, None]).squeeze(1) == logits.amax(dim=-1)).sum()
