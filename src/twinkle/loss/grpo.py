"""GRPO's policy losses over sampled completions: ``GRPOLoss`` and its variants ``GSPOLoss``,
``DRGRPOLoss``, ``CISPOLoss``, ``BNPOLoss`` (and ``SAPOLoss`` in ``twinkle.loss.sapo``).

Each batch row is a prompt plus one sampled completion (the sampler's ``new_input_feature``:
labels on the completion). The step passes, per row, the sampler's log-probability of each
completion token (``old_logps``: ``(B, L)`` aligned with ``labels``, or one list per row holding
only the completion's values, as ``[lp[0][1] for lp in seq.logprobs]``) and the row's advantage
(``advantages``: ``(B,)``), and with ``beta > 0`` the reference's log-probabilities
(``ref_outputs=model.forward_only(inputs=batch, disable_lora=True)``):

    model.set_loss("GRPOLoss", epsilon=0.2)
    model.forward_backward(inputs=rows, old_logps=old, advantages=adv)

Per completion token ``t`` with the policy's ``logp_t``, ``ratio_t = exp(logp_t - old_t)``:

- ``GRPOLoss``: ``-min(ratio_t * A, clip(ratio_t, 1 - epsilon, 1 + epsilon_high) * A)``, plus
  ``beta`` times the k3 estimate of KL to the reference, ``exp(ref_t - logp_t) - (ref_t -
  logp_t) - 1``; the mean over each completion's tokens, then the mean over completions.
- ``GSPOLoss`` (Zheng et al. 2025, arXiv 2507.18071): the same clip on one ratio per completion,
  ``exp(mean_t(logp_t - old_t))``.
- ``DRGRPOLoss`` (Liu et al. 2025, arXiv 2503.20783): GRPO's token terms summed over each
  completion and divided by the constant ``max_tokens`` (no length normalisation).
- ``CISPOLoss`` (MiniMax 2025, arXiv 2506.13585): ``-sg(min(ratio_t, 1 + epsilon_high)) * A *
  logp_t``, the mean over every completion token of the batch.
- ``BNPOLoss``: GRPO's token terms, the mean over every completion token of the batch (a long
  completion weighs more than a short one, where GRPO weighs completions equally).

A loss returns its sum over completions with ``num_tokens`` the number of completions (tokens
for ``CISPOLoss``): the model divides a window's summed loss by that count over all ranks, so a
step is the mean over every completion of the global batch. ``num_correct`` is the clipped
count in the same units (each completion's share of tokens whose clipped term was taken, summed;
clipped tokens for ``CISPOLoss``; clipped completions for ``GSPOLoss``), so the model reports
``clip_fraction`` (``correct_metric``) in place of its token ``accuracy``."""

import math
from collections.abc import Mapping
from typing import Any

import torch

from twinkle.loss.base import ROWS, HeadLoss, LossView
from twinkle.loss.cross_entropy import LossOutput
from twinkle.loss.preference import row_logps
from twinkle.loss.sequence_share import count_once, once, total
from twinkle.loss.upstream_keywords import check_upstream_keywords
from twinkle.utils.errors import UserError


def _check(loss: str, name: str, value: Any, low: float = 0.0, strict: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (strict and value == low):
        bound = f"above {low:g}" if strict else f"at least {low:g}"
        raise UserError(f"{loss}: {name} must be a number {bound}, got {value!r}")
    return float(value)


class GRPOLoss(HeadLoss):
    """See the module docstring. ``epsilon``: the clip below (``1 - epsilon``) and, unless
    ``epsilon_high`` is given, above; ``beta``: the KL coefficient (0: no reference needed).
    Called as upstream calls a loss (``twinkle.loss.base``), ``inputs`` holds ``old_logps``,
    ``advantages`` and ``ref_logps`` as the step takes them; the result is ``{"loss": summed
    loss, "num_tokens": its count}``."""

    consumes = ROWS
    require_samples = True
    sequence_parallel = True  # a completion's sums are totalled over a Ulysses group (_per_row)
    reduction = "sum"  # the summed per-completion loss; the model divides by the completions
    correct_metric = "clip_fraction"  # the name the model reports num_correct / num_tokens under
    count_metric = "completions"  # the name the model reports num_tokens under

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        entropy_coef: float = 0.0,
        ignore_index: int = -100,
    ):
        self.epsilon = _check(self.name, "epsilon", epsilon)
        high = epsilon if epsilon_high is None else epsilon_high
        self.epsilon_high = _check(self.name, "epsilon_high", high)
        self.beta = _check(self.name, "beta", beta)
        self.entropy_coef, self.ignore_index = check_upstream_keywords(self.name, entropy_coef, ignore_index)
        self.extra_inputs = ("old_logps", "advantages") + (("ref_logps",) if self.beta > 0 else ())

    def upstream_batch(self, inputs: dict[str, Any], outputs: Mapping[str, Any]) -> dict[str, Any]:
        """Upstream's call without ``old_logps`` is on-policy: the policy's own detached values
        stand in (every ratio 1); ``(B, 1)`` advantages are one per row."""
        adv = inputs.get("advantages")
        if torch.is_tensor(adv) and adv.dim() == 2 and adv.shape[1] == 1:
            inputs["advantages"] = adv[:, 0]
        if inputs.get("old_logps") is None:
            inputs["old_logps"] = _own_logps(inputs["labels"], outputs.get("logps"), outputs.get("logits"))
        return inputs

    # ----------------------------------------------------------------- per token and per completion
    def token_terms(self, logps: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        """Each completion token's policy term (``(N,)``)."""
        ratio = torch.exp((logps - old).clamp(-20.0, 20.0))
        clipped = ratio.clamp(1 - self.epsilon, 1 + self.epsilon_high)
        return -torch.minimum(ratio * adv, clipped * adv)

    def clipped(self, logps: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        """Tokens whose clipped term was the one taken (no gradient through them)."""
        ratio = torch.exp((logps - old).clamp(-20.0, 20.0))
        return ((ratio > 1 + self.epsilon_high) & (adv > 0)) | ((ratio < 1 - self.epsilon) & (adv < 0))

    def clip_count(
        self, logps: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, samples, rows, sequence=None
    ) -> torch.Tensor:
        """Each completion's clipped share of its tokens, summed over completions. ``sequence``:
        the Ulysses group holding the completions' other tokens (``twinkle.loss.sequence_share``)."""
        shares, lengths = _per_row(self.clipped(logps, old, adv).to(logps.dtype), samples, rows, sequence)
        kept = lengths > 0
        return count_once((shares[kept] / lengths[kept]).sum(), sequence)

    def reduce(
        self, terms: torch.Tensor, samples: torch.Tensor, rows: int, sequence=None
    ) -> tuple[torch.Tensor, int]:
        """(sum over completions of each one's token mean, completions)."""
        sums, lengths = _per_row(terms, samples, rows, sequence)
        kept = lengths > 0
        return once((sums[kept] / lengths[kept]).sum(), sequence), count_once(int(kept.sum()), sequence)

    def kl(self, logps: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor:
        """Each token's k3 estimate of KL(policy || reference)."""
        if ref is None:
            raise UserError(f"{self.name}(beta={self.beta}) needs ref_logps; pass ref_outputs= to the step")
        diff = ref - logps
        return torch.exp(diff) - diff - 1

    def sequence_loss(
        self,
        logps: torch.Tensor,
        old: torch.Tensor,
        adv: torch.Tensor,
        ref: Any,
        samples: torch.Tensor,
        rows: int,
        sequence: Any = None,
    ) -> tuple[torch.Tensor, int]:
        """(the summed loss, its count) of one micro-batch's completion tokens."""
        terms = self.token_terms(logps, old, adv)
        if self.beta > 0:
            terms = terms + self.beta * self.kl(logps, ref)
        return self.reduce(terms, samples, rows, sequence)

    # ----------------------------------------------------------------- the protocol
    def compute(self, view: LossView) -> LossOutput:
        if view.samples is None:
            raise UserError(f"{self.name} needs each row's sample; run it through model.set_loss")
        extras = view.extras
        return self.from_rows(
            row_logps(view),
            extras["old_logps"],
            extras["advantages"],
            view.samples,
            view.rows,
            extras.get("ref_logps"),
            view.sequence,
        )

    def from_rows(
        self,
        logps: torch.Tensor,
        old: torch.Tensor,
        adv: torch.Tensor,
        samples: torch.Tensor,
        rows: int,
        ref: torch.Tensor | None = None,
        sequence: Any = None,
    ) -> LossOutput:
        """The loss from the completion tokens' log-probabilities ``(N,)`` (with the graph), the
        sampler's ``old`` and each token's row advantage ``adv`` at the same tokens, their batch
        rows ``samples`` ``(N,)``, the batch's row count, and the reference's values.
        ``sequence``: the Ulysses group whose ranks hold the completions' other tokens (their
        per-completion sums are totalled over it first)."""
        if logps.numel() == 0 and sequence is None:  # a rank's empty share: backward must still run
            zero = logps.sum() * 0.0
            return LossOutput(zero, zero, 0, torch.zeros((), dtype=torch.long))
        old = old.detach().to(logps.device, logps.dtype)
        adv = adv.detach().to(logps.device, logps.dtype)
        ref = None if ref is None else ref.detach().to(logps.device, logps.dtype)
        samples = samples.to(logps.device)
        loss_sum, count = self.sequence_loss(logps, old, adv, ref, samples, rows, sequence)
        correct = self.clip_count(logps.detach(), old, adv, samples, rows, sequence)
        return LossOutput(loss_sum / max(1, count), loss_sum, count, correct)


def _own_logps(labels: Any, logps: Any, logits: Any) -> torch.Tensor:
    """The policy's own detached per-label log-probabilities (``(B, L)``), from ``logps`` or the
    logits (-100 labels read token 0, whose value no loss term uses)."""
    if logps is not None:
        return logps.detach()
    targets = torch.as_tensor(labels).to(logits.device).clamp(min=0)
    return torch.log_softmax(logits.detach().float(), dim=-1).gather(-1, targets[..., None])[..., 0]


def _per_row(
    values: torch.Tensor, samples: torch.Tensor, rows: int, sequence: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each batch row's sum of ``values`` and its count of tokens, over the ``sequence`` group's
    ranks when there is one (each holds a share of the row's tokens)."""
    sums = torch.zeros(rows, dtype=values.dtype, device=values.device).index_add(0, samples, values)
    lengths = torch.bincount(samples, minlength=rows).to(values.dtype)
    if sequence is None:
        return sums, lengths
    both = total(torch.stack([sums, lengths]), sequence)  # one all-reduce for the two
    return both[0], both[1]


class GSPOLoss(GRPOLoss):
    """One importance ratio per completion, ``exp(mean_t(logp_t - old_t))``, clipped to ``[1 -
    epsilon, 1 + epsilon_high]`` (GSPO's ranges are small: 3e-4 and 4e-4 in its paper); the KL
    term, when ``beta > 0``, is each completion's token mean. The mean over completions."""

    def __init__(
        self,
        epsilon: float = 3e-4,
        epsilon_high: float | None = 4e-4,
        beta: float = 0.0,
        entropy_coef: float = 0.0,
        ignore_index: int = -100,
    ):
        super().__init__(epsilon, epsilon_high, beta, entropy_coef, ignore_index)

    def sequence_loss(self, logps, old, adv, ref, samples, rows, sequence=None):
        log_ratio, lengths = _per_row((logps - old).clamp(-20.0, 20.0), samples, rows, sequence)
        kept = lengths > 0
        seq_adv = _per_row(adv, samples, rows, sequence)[0][kept] / lengths[kept]  # the row's advantage
        ratio = torch.exp(log_ratio[kept] / lengths[kept])
        clipped = ratio.clamp(1 - self.epsilon, 1 + self.epsilon_high)
        values = -torch.minimum(ratio * seq_adv, clipped * seq_adv)
        if self.beta > 0:
            kl = _per_row(self.kl(logps, ref), samples, rows, sequence)[0]
            values = values + self.beta * kl[kept] / lengths[kept]
        return once(values.sum(), sequence), count_once(int(kept.sum()), sequence)

    def clip_count(self, logps, old, adv, samples, rows, sequence=None):
        """Completions whose clipped ratio was the one taken."""
        log_ratio, lengths = _per_row((logps - old).clamp(-20.0, 20.0), samples, rows, sequence)
        kept = lengths > 0
        ratio = torch.exp(log_ratio[kept] / lengths[kept])
        seq_adv = _per_row(adv, samples, rows, sequence)[0][kept] / lengths[kept]
        high = (ratio > 1 + self.epsilon_high) & (seq_adv > 0)
        return count_once((high | ((ratio < 1 - self.epsilon) & (seq_adv < 0))).sum(), sequence)


class DRGRPOLoss(GRPOLoss):
    """GRPO's token terms summed per completion and divided by ``max_tokens`` (the sampling
    budget, a constant: long and short completions weigh per token the same), then the mean
    over completions. ``max_completion_length`` is upstream's name for ``max_tokens``."""

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        max_tokens: int = 1024,
        entropy_coef: float = 0.0,
        ignore_index: int = -100,
        max_completion_length: int | None = None,
    ):
        super().__init__(epsilon, epsilon_high, beta, entropy_coef, ignore_index)
        if max_completion_length is not None:  # upstream's name for the budget
            if max_tokens not in (1024, max_completion_length):
                raise UserError(
                    f"{self.name}: max_tokens={max_tokens} and max_completion_length={max_completion_length} "
                    "name the same budget; give one"
                )
            max_tokens = max_completion_length
        self.max_completion_length = None
        if not (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1):
            raise UserError(
                f"{self.name}: max_tokens must be an integer >= 1 (the sampling budget), got {max_tokens!r}"
            )
        self.max_tokens = max_tokens

    def reduce(self, terms, samples, rows, sequence=None):
        sums, lengths = _per_row(terms, samples, rows, sequence)
        kept = lengths > 0
        return once(sums[kept].sum() / self.max_tokens, sequence), count_once(int(kept.sum()), sequence)


class CISPOLoss(GRPOLoss):
    """``-sg(min(ratio_t, 1 + epsilon_high)) * A * logp_t`` (every token keeps a gradient; only
    the weight is clipped), plus the KL term when ``beta > 0``; the mean over every completion
    token of the global batch (``num_tokens`` counts tokens)."""

    count_metric = "supervised_tokens"

    def token_terms(self, logps: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        weight = torch.exp((logps - old).clamp(-20.0, 20.0)).clamp(max=1 + self.epsilon_high).detach()
        return -weight * adv * logps

    def clipped(self, logps: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        return torch.exp((logps - old).clamp(-20.0, 20.0)) > 1 + self.epsilon_high

    def clip_count(self, logps, old, adv, samples, rows, sequence=None):
        """Clipped tokens (the loss counts tokens; each rank of a Ulysses group its own)."""
        return self.clipped(logps, old, adv).sum()

    def reduce(self, terms, samples, rows, sequence=None):
        return terms.sum(), int(terms.numel())  # a sum over tokens: each rank its own share


class BNPOLoss(GRPOLoss):
    """GRPO's token terms (clip and KL alike), the mean over every completion token of the global
    batch (``num_tokens`` counts tokens, and so does the clipped count)."""

    count_metric = "supervised_tokens"

    def clip_count(self, logps, old, adv, samples, rows, sequence=None):
        return self.clipped(logps, old, adv).sum()

    def reduce(self, terms, samples, rows, sequence=None):
        return terms.sum(), int(terms.numel())  # a sum over tokens: each rank its own share
