"""The Tinker losses as one twinkle loss that also keeps what the SDK returns per token.

Every target token of a datum is labelled, so the model hands the loss all of them (in the
batch's row-major order, ``twinkle.loss.base``); the tokens that do not count (weight 0 for
``cross_entropy``, advantage 0 for ``importance_sampling`` and ``ppo``) add zero to the loss
and are left out of its token count, so a ``token_mean`` window's step (``twinkle_client``'s)
averages over the counted tokens only (as if they were unlabelled); the default step applies the
summed loss's gradient and ignores the count (``twinkle.server.engine``). The same pass keeps each token's log-probability and loss
(``last_logps``, ``last_per_token``): ``forward_backward`` needs no second forward for them.

The per-token objectives are ``TokenWeightedCrossEntropyLoss``'s (``-w * logp``) and those of
``twinkle.loss.importance_sampling`` / ``twinkle.loss.ppo``."""

from typing import Any

import torch

from twinkle.loss.base import HeadLoss, LossView
from twinkle.loss.cross_entropy import finish, top_is_target
from twinkle.loss.importance_sampling import ImportanceSamplingLoss, token_logps
from twinkle.loss.ppo import PPOLoss

KINDS = ("cross_entropy", "importance_sampling", "ppo")


class TinkerLoss(HeadLoss):
    """``kind``: one of ``KINDS``; ``config``: the request's ``loss_fn_config`` (``ppo``:
    ``clip_low_threshold``/``clip_high_threshold``, the ratio's bounds, default 0.8 and 1.2)."""

    def __init__(self, kind: str, config: dict[str, Any]):
        self.kind = kind
        self.reduction = "sum"
        if kind == "cross_entropy":
            self.extra_inputs = ("tinker_weights",)
            self.policy = None
        else:
            self.extra_inputs = ("old_logps", "advantages")
            low = float(config.get("clip_low_threshold", 0.8))
            high = float(config.get("clip_high_threshold", 1.2))
            self.policy = PPOLoss(1.0 - low, high - 1.0) if kind == "ppo" else ImportanceSamplingLoss()
        self.last_logps: torch.Tensor | None = None
        self.last_per_token: torch.Tensor | None = None

    @property
    def name(self) -> str:
        return f"tinker:{self.kind}"

    def compute(self, view: LossView) -> Any:
        logits, logps = token_logps(view)
        if self.policy is None:
            weights = view.extras["tinker_weights"].to(logps.device, torch.float32)
            per_token, counted = -logps * weights, weights != 0
        else:
            old = view.extras["old_logps"].to(logps.device, torch.float32)
            advantages = view.extras["advantages"].to(logps.device, torch.float32)
            per_token = self.policy.objective(torch.exp(logps - old), advantages)
            counted = advantages != 0
        self.last_logps, self.last_per_token = logps.detach().cpu(), per_token.detach().cpu()
        correct = top_is_target(logits.detach()[counted], view.targets[counted])
        return finish(per_token.sum(), int(counted.sum()), correct, self.reduction)
