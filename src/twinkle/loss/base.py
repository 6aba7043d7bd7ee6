"""``Loss``: what ``model.set_loss`` takes; ``HeadLoss``: a loss the model applies from hidden states.

Two call conventions meet here:

- upstream's, ``loss(inputs, outputs) -> {"loss", "num_tokens"}``: ``inputs["labels"]`` holds
  each position's target (already shifted, ``-100`` where none) and ``outputs`` holds
  ``logps`` (the targets' log-probabilities) and/or ``logits``. Any ``Loss`` subclass or plain
  callable of this shape works with ``model.set_loss``; the model then builds the logits.
- the model's own, ``loss(hidden, weight, targets, bias=None) -> LossOutput``: the final hidden
  states of the supervised positions, the output head's weight and the targets, so the
  ``(batch, seq, vocab)`` logits are never built. ``HeadLoss`` subclasses provide both and pick
  by the first argument: a tensor is the model's convention, a mapping upstream's."""

from collections.abc import Mapping
from typing import Any

import torch


class Loss:
    """Base of the losses ``model.set_loss`` takes. ``require_logps``: the model hands the
    targets' log-probabilities (``outputs["logps"]``); ``require_logits``: it hands the logits
    too (they are left out otherwise, as they are the largest tensor of the step)."""

    require_logits = False
    require_entropy = False
    require_logps = True

    def __call__(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any], **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(inputs, outputs)")


class HeadLoss(Loss):
    """A token loss the model computes from hidden states and the head (``head_loss``), or from
    already materialised logits of the supervised positions (``logits_loss``: models whose head
    post-processes its logits, or carries a LoRA). ``reduction`` (``sum`` or ``mean``) decides
    only the value the loss reports: training always uses the summed loss (``loss_sum``)
    divided by the supervised tokens of the whole global batch."""

    reduction = "sum"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and torch.is_tensor(args[0]):
            return self.head_loss(*args, **kwargs)
        return self.from_outputs(*args, **kwargs)

    def head_loss(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> Any:
        raise NotImplementedError

    def logits_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> Any:
        raise NotImplementedError

    def from_outputs(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> dict:
        raise NotImplementedError
