"""Cross-entropy on supervised positions only: ``CrossEntropyLoss`` and the helpers every token
loss shares.

On the model's path a loss takes the final hidden states of the positions whose next token is
supervised (``(N, hidden)``), the head weight (``(vocab, hidden)``) and the targets (``(N,)``).
Positions whose label is -100 (prompts, padding) never reach the head: in SFT they are most of
the tokens, and their logits would be computed only to be thrown away. Called as
``loss(inputs, outputs)`` (upstream's convention, see ``twinkle.loss.base``), the same losses
read those rows of ``outputs["logits"]``, or of ``outputs["logps"]`` (``logps_output``)."""

import torch
import torch.nn.functional as F

from twinkle.loss.base import HeadLoss, LossView
from twinkle.loss.head import head_logits
from twinkle.loss.output import IGNORE_INDEX, LossOutput, top_is_target
from twinkle.utils.errors import UserError

REDUCTIONS = ("sum", "mean")


def check_reduction(reduction: str) -> str:
    if reduction not in REDUCTIONS:
        raise UserError(f"reduction={reduction!r} is not supported; use one of {', '.join(REDUCTIONS)}")
    return reduction


def finish(loss_sum: torch.Tensor, num_tokens: int, num_correct: torch.Tensor, reduction: str) -> LossOutput:
    loss = loss_sum if reduction == "sum" else loss_sum / max(1, num_tokens)
    return LossOutput(loss=loss, loss_sum=loss_sum, num_tokens=num_tokens, num_correct=num_correct)


def drop_ignored(
    rows: torch.Tensor, targets: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows whose target is not ``ignore_index``. The model never passes a -100 target, so
    with the default ``ignore_index`` this is the identity (no copy)."""
    if ignore_index == IGNORE_INDEX:
        return rows, targets
    keep = targets != ignore_index
    return rows[keep], targets[keep]


def dft_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Dynamic fine-tuning (arXiv 2508.05629): each token's ``-log p`` weighted by its own
    probability ``p``, taken as a constant (the paper's stop-gradient), summed."""
    logp = -F.cross_entropy(logits, targets, reduction="none")
    return (-(logp.detach().exp()) * logp).sum()


def target_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)`` at each position's label (fp32; an ignored label reads index 0)."""
    logps = torch.log_softmax(logits.float(), dim=-1)
    return logps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def logps_output(view: LossView, ignore_index: int, reduction: str, dft: bool) -> LossOutput:
    """The cross-entropy of a view that holds only its rows' target log-probabilities
    (``view.logps``, upstream's ``outputs["logps"]``): ``-sum(logp)`` (``dft``: each term
    weighted by its probability, as ``dft_loss_sum``). Without logits no token counts as
    correct."""
    logps, targets = drop_ignored(view.logps, view.targets, ignore_index)
    per_token = -(logps.detach().exp()) * logps if dft else -logps
    correct = torch.zeros((), dtype=torch.long, device=logps.device)
    return finish(per_token.sum(), targets.numel(), correct, reduction)


class CrossEntropyLoss(HeadLoss):
    """Materialise the logits of the supervised positions, then ``F.cross_entropy`` in fp32.

    Upstream's constructor: ``ignore_index`` (a label left out of the loss besides -100, which
    the model never scores), ``reduction`` (``mean`` or ``sum``: the reported value only, see
    ``HeadLoss``) and ``dft`` (``dft_loss_sum``). The model's default loss is this class with
    ``reduction="sum"``."""

    def __init__(self, ignore_index: int = IGNORE_INDEX, reduction: str = "mean", dft: bool = False):
        self.ignore_index = ignore_index
        self.reduction = check_reduction(reduction)
        self.dft = bool(dft)

    def compute(self, view: LossView) -> LossOutput:
        if view.hidden is not None:
            hidden, targets = drop_ignored(view.hidden, view.targets, self.ignore_index)
            return self._loss(head_logits(hidden, view.weight, view.bias).float(), targets)
        if view.logits is not None:
            return self._loss(*drop_ignored(view.logits.float(), view.targets, self.ignore_index))
        return logps_output(view, self.ignore_index, self.reduction, self.dft)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> LossOutput:
        if self.dft:
            loss_sum = dft_loss_sum(logits, targets)
        else:
            loss_sum = F.cross_entropy(logits, targets, reduction="sum")
        num_correct = top_is_target(logits.detach(), targets)
        return finish(loss_sum, targets.numel(), num_correct, self.reduction)
