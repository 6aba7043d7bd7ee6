"""The Tinker losses as one twinkle loss that also keeps what the SDK returns per token.

Every target token of a datum is labelled, so the model hands the loss all of them (in the
batch's row-major order, ``twinkle.loss.base``); the tokens that do not count (weight 0 for
``cross_entropy``, advantage 0 for ``importance_sampling`` and ``ppo``) add zero to the loss
and are left out of its token count, so a ``token_mean`` window's step (``twinkle_client``'s)
averages over the counted tokens only (as if they were unlabelled); the default step applies the
summed loss's gradient and ignores the count (``twinkle.server.core``). The same pass keeps each token's log-probability and loss
(``last_logps``, ``last_per_token``): ``forward_backward`` needs no second forward for them.
Only the counted tokens go through the head with a graph; the others' log-probabilities are
computed without one, in chunks: in an SFT datum most tokens are prompt (weight 0), and their
``(tokens, vocab)`` logits and gradient would otherwise dominate the step's memory and time.

The per-token objectives are ``TokenWeightedCrossEntropyLoss``'s (``-w * logp``) and those of
``twinkle.loss.importance_sampling`` / ``twinkle.loss.ppo``."""

from typing import Any

import torch

from twinkle.loss.base import HeadLoss, LossView
from twinkle.loss.cross_entropy import finish, top_is_target
from twinkle.loss.importance_sampling import ImportanceSamplingLoss, token_logps
from twinkle.loss.ppo import PPOLoss

KINDS = ("cross_entropy", "importance_sampling", "ppo")
CHUNK = 1024  # tokens a head call scores without a graph: 1024 x 49152 fp32 logits are 192 MiB


class TinkerLoss(HeadLoss):
    """``kind``: one of ``KINDS``; ``config``: the request's ``loss_fn_config`` (``ppo``:
    ``clip_low_threshold``/``clip_high_threshold``, the ratio's bounds, default 0.8 and 1.2)."""

    def __init__(self, kind: str, config: dict[str, Any]):
        self.kind = kind
        self.reduction = "sum"
        # a composite step's divisor (``twinkle.server.objectives``): the loss's own count, not
        # the counted tokens; on rank 0 only, as the model sums the counts over the ranks
        count = config.get("twinkle_count")
        self.count = None if count is None else int(count) * int(_rank() == 0)
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
        if self.policy is None:
            weights = view.extras["tinker_weights"].to(view.targets.device, torch.float32)
            counted = weights != 0
        else:
            old = view.extras["old_logps"].to(view.targets.device, torch.float32)
            advantages = view.extras["advantages"].to(view.targets.device, torch.float32)
            counted = advantages != 0
        logits, counted_logps = token_logps(_rows(view, counted))
        logps = torch.empty(view.targets.shape, dtype=torch.float32, device=view.targets.device)
        logps[counted] = counted_logps.detach()
        logps[~counted] = _logps_without_graph(view, ~counted)
        if self.policy is None:
            per_token = -counted_logps * weights[counted]
            reported = -logps * weights
        else:
            per_token = self.policy.objective(torch.exp(counted_logps - old[counted]), advantages[counted])
            reported = self.policy.objective(torch.exp(logps - old), advantages)
        reported[counted] = per_token.detach()
        self.last_logps, self.last_per_token = logps.cpu(), reported.cpu()
        correct = top_is_target(logits.detach(), view.targets[counted])
        count = int(counted.sum()) if self.count is None else self.count
        return finish(per_token.sum(), count, correct, self.reduction)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _rows(view: LossView, rows: torch.Tensor) -> LossView:
    """The view restricted to ``rows`` (a boolean mask over its tokens, or their indices)."""
    if view.hidden is not None:
        return LossView(
            targets=view.targets[rows], hidden=view.hidden[rows], weight=view.weight, bias=view.bias
        )
    return LossView(targets=view.targets[rows], logits=view.logits[rows])


@torch.no_grad()
def _logps_without_graph(view: LossView, rows: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the targets of ``rows``, ``CHUNK`` tokens at a time, no graph kept;
    rows at one packed position (a scored shared prefix, ``LossView.positions``) scored once."""
    index, inverse = rows.nonzero().squeeze(1), None
    if view.positions is not None and index.numel():
        unique, inverse = torch.unique(view.positions[index], return_inverse=True)
        index = torch.empty_like(unique).scatter_(0, inverse, index)  # a row at each position
    parts = [token_logps(_rows(view, index[i : i + CHUNK]))[1] for i in range(0, index.numel(), CHUNK)]
    logps = torch.cat(parts) if parts else torch.zeros(0, device=view.targets.device)
    return logps if inverse is None else logps[inverse]
