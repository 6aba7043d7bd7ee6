"""``ImportanceSamplingLoss``: the policy-gradient loss of tokens sampled by another policy.

Each supervised token ``t`` has the sampler's log-probability ``old_logps_t`` and an advantage
``A_t`` (batch tensors aligned with ``labels``, ``extra_inputs``). With the trained policy's
log-probability ``logp_t`` the loss is ``-sum_t exp(logp_t - old_logps_t) * A_t``, the
Tinker SDK's ``importance_sampling`` loss; its gradient is the importance-weighted policy
gradient. Use it with ``model.set_loss(ImportanceSamplingLoss())`` and
``forward_backward(batch, old_logps=..., advantages=...)``."""

import torch
import torch.nn.functional as F

from twinkle.loss.base import HeadLoss, LossView
from twinkle.loss.cross_entropy import LossOutput, check_reduction, finish, top_is_target
from twinkle.loss.head import head_logits
from twinkle.utils.errors import UserError


def token_logps(view: LossView, loss: str = "this loss") -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 logits, log-probability of each target) of the view's supervised rows; a view
    without logits or hidden states (upstream's ``outputs["logps"]`` alone) is a one-line error."""
    if view.hidden is None and view.logits is None:
        raise UserError(
            f"{loss} needs the logits; pass outputs['logits'] (or the hidden states with outputs['lm_head'])"
        )
    logits = view.logits
    if view.hidden is not None:  # through oneDNN on a CPU, as the cross-entropy's head
        logits = head_logits(view.hidden, view.weight, view.bias)
    logits = logits.float()
    return logits, -F.cross_entropy(logits, view.targets, reduction="none")


class ImportanceSamplingLoss(HeadLoss):
    """``-sum(ratio * advantages)`` with ``ratio = exp(logp - old_logps)``; ``reduction`` decides
    only the reported value (``sum`` or per-token ``mean``)."""

    sequence_parallel = True  # a sum over tokens: a Ulysses rank's share needs its own inputs only

    def __init__(
        self, reduction: str = "sum", old_key: str = "old_logps", advantages_key: str = "advantages"
    ):
        self.reduction = check_reduction(reduction)
        self.old_key, self.advantages_key = old_key, advantages_key
        self.extra_inputs = (old_key, advantages_key)

    def objective(self, ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        """Per-token loss from the probability ratio and the advantages."""
        return -ratio * advantages

    def compute(self, view: LossView) -> LossOutput:
        logits, logps = token_logps(view, self.name)
        old = view.extras[self.old_key].to(logps.device, torch.float32)
        advantages = view.extras[self.advantages_key].to(logps.device, torch.float32)
        ratio = torch.exp(logps - old)
        loss_sum = self.objective(ratio, advantages).sum()
        correct = top_is_target(logits.detach(), view.targets)
        return finish(loss_sum, view.targets.numel(), correct, self.reduction)
