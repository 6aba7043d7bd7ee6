"""Cross-entropy from hidden states and the output head, on supervised positions only.

Every loss here takes the final hidden states of the positions whose next token is supervised
(``(N, hidden)``), the head weight (``(vocab, hidden)``) and the targets (``(N,)``). Positions
whose label is -100 (prompts, padding) never reach the head: in SFT they are most of the
tokens, and their logits would be computed only to be thrown away."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

REDUCTIONS = ("sum", "mean")


@dataclass
class LossOutput:
    """``loss`` as the loss function reports it (``reduction``); ``loss_sum`` is always the
    summed token loss the trainer normalises by the global token count."""

    loss: torch.Tensor
    loss_sum: torch.Tensor
    num_tokens: int
    num_correct: torch.Tensor


def check_reduction(reduction: str) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    return reduction


def finish(loss_sum: torch.Tensor, num_tokens: int, num_correct: torch.Tensor, reduction: str) -> LossOutput:
    loss = loss_sum if reduction == "sum" else loss_sum / max(1, num_tokens)
    return LossOutput(loss=loss, loss_sum=loss_sum, num_tokens=num_tokens, num_correct=num_correct)


def top_is_target(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """How many rows' target logit is the row's maximum (the accuracy metric's count; a tie at
    the top counts, where ``argmax`` would pick the first; the fused loss counts the same way)."""
    return (logits.gather(1, targets[:, None]).squeeze(1) == logits.amax(dim=-1)).sum()


class CrossEntropyLoss:
    """Materialise the logits of the supervised positions, then ``F.cross_entropy`` in fp32."""

    def __init__(self, reduction: str = "sum"):
        self.reduction = check_reduction(reduction)

    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> LossOutput:
        logits = F.linear(hidden, weight, bias).float()
        loss_sum = F.cross_entropy(logits, targets, reduction="sum")
        num_correct = top_is_target(logits.detach(), targets)
        return finish(loss_sum, targets.numel(), num_correct, self.reduction)
