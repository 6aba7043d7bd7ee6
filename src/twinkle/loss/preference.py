"""Preference losses over pairs of rows: ``PreferenceLoss`` (their shared part) and the
reference-free ``SimPOLoss``, ``CPOLoss`` and ``ORPOLoss``; ``DPOLoss`` is in ``twinkle.loss.dpo``.

A preference batch holds its rows interleaved, ``[chosen_1, rejected_1, chosen_2, rejected_2,
...]``: rows ``2i`` and ``2i + 1`` are pair ``i``. Each row's log-probability is the sum of its
supervised tokens' log-probabilities (its response). The model hands these losses the supervised
rows (``consumes = "rows"``, ``twinkle.loss.base``) with each row's sample; a loss computes one
value per pair and returns their sum with ``num_tokens`` = the number of pairs, so a training
step (the summed loss over the global batch divided by its count over all ranks) is the mean
over every pair of the global batch. ``num_correct`` counts the pairs whose chosen row the
loss's implicit reward prefers, so the model's built-in ``accuracy`` is that share of the pairs.

An NLL term on the chosen row (``CPOLoss``, ``ORPOLoss``, ``DPOLoss(sft_weight=)``) is its mean
token negative log-likelihood, one value per pair, so it too is a mean over pairs."""

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from twinkle.loss.base import ROWS, HeadLoss, LossView
from twinkle.loss.cross_entropy import LossOutput
from twinkle.loss.head_logps import head_logps
from twinkle.loss.sequence_share import count_once, once, total
from twinkle.loss.upstream_keywords import check_ignore_index
from twinkle.utils.errors import UserError


@dataclass
class PreferenceOutput(LossOutput):
    """``LossOutput`` plus ``logps``: the supervised rows' target log-probabilities ``(N,)``,
    detached, in the view's row order (the model hands them to the metrics)."""

    logps: torch.Tensor | None = None


@dataclass
class Pairs:
    """Per-pair sums of one micro-batch: the chosen and rejected rows' summed log-probabilities,
    their supervised-token counts and, when given, the reference's summed log-probabilities."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_len: torch.Tensor
    rejected_len: torch.Tensor
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None


def check_positive(loss: str, name: str, value: float, usual: float) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise UserError(
            f"{loss}: {name} must be above 0, got {value!r}; pass a positive {name} ({usual} is usual)"
        )
    return float(value)


def check_non_negative(loss: str, name: str, value: float) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise UserError(f"{loss}: {name} must be 0 or more, got {value!r}; pass a number at least 0")
    return float(value)


def row_logps(view: LossView) -> torch.Tensor:
    """Each supervised row's target log-probability, with the graph to the policy: ``view.logps``
    when the view holds them, else computed in fp32 from the hidden states and the head, or from
    the logits."""
    if view.logps is not None:
        return view.logps
    if view.hidden is not None:
        return head_logps(view.hidden, view.weight, view.targets, view.bias)
    return -F.cross_entropy(view.logits.float(), view.targets, reduction="none")


def mean_nll(logps_sum: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    return -logps_sum / length


def log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable at both ends (``expm1`` near 0, ``log1p`` far)."""
    x = x.clamp(max=-1e-7)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


class PreferenceLoss(HeadLoss):
    """The pair bookkeeping shared by the preference losses; a subclass implements
    ``pair_losses(pairs) -> (loss per pair, preference logit per pair)`` and declares
    ``extra_inputs = ("ref_logps",)`` when it reads the reference's log-probabilities (per label,
    ``(B, L)`` aligned with ``labels``: ``model.forward_only(...)["logps"]``). Called as upstream
    calls a loss (``twinkle.loss.base``), ``outputs["logps"]`` is ``(B, L)`` aligned with
    ``inputs["labels"]`` and the result is ``{"loss": summed pair loss, "num_tokens": pairs}``."""

    consumes = ROWS
    require_samples = True
    sequence_parallel = True  # a row's sums are totalled over a Ulysses group (_pairs)
    reduction = "sum"  # the summed pair loss; the model divides by the pairs of the global batch
    count_metric = "pairs"  # the name the model reports num_tokens under

    def pair_losses(self, pairs: Pairs) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def compute(self, view: LossView) -> PreferenceOutput:
        if view.samples is None:
            raise UserError(f"{self.name} needs each row's sample; run it through model.set_loss")
        return self.from_rows(
            row_logps(view), view.samples, view.rows, view.extras.get("ref_logps"), view.sequence
        )

    def from_rows(
        self,
        logps: torch.Tensor,
        samples: torch.Tensor,
        rows: int,
        ref: torch.Tensor | None = None,
        sequence: Any = None,
    ) -> PreferenceOutput:
        """The loss from the supervised rows' log-probabilities ``(N,)``, their batch rows
        ``(N,)``, the batch's row count and the reference's values at the same rows.
        ``sequence``: the Ulysses group whose ranks hold the rows' other tokens (each row's sums
        are totalled over it first, ``twinkle.loss.sequence_share``)."""
        empty = logps.numel() == 0
        if sequence is not None:  # a rank's share may be empty while the group's is not
            empty = not bool(total(logps.new_tensor([float(logps.numel())]), sequence)[0])
        if empty:  # nothing to pair, but backward must run
            zero = logps.sum() * 0.0
            return PreferenceOutput(zero, zero, 0, torch.zeros((), dtype=torch.long), logps.detach())
        if rows % 2:
            raise UserError(
                f"{self.name} needs rows in pairs [chosen_1, rejected_1, chosen_2, ...], but the batch "
                f"has {rows} rows; keep both sides of every pair in the batch"
            )
        pairs = self._pairs(logps, samples, rows, ref, sequence)
        losses, logits = self.pair_losses(pairs)
        loss_sum = once(losses.sum(), sequence)
        count = count_once(losses.numel(), sequence)
        correct = count_once((logits.detach() > 0).sum(), sequence)
        return PreferenceOutput(loss_sum / max(1, count), loss_sum, count, correct, logps.detach())

    def _pairs(
        self,
        logps: torch.Tensor,
        samples: torch.Tensor,
        rows: int,
        ref: torch.Tensor | None,
        sequence: Any = None,
    ) -> Pairs:
        samples = samples.to(logps.device)
        sums = torch.zeros(rows, dtype=logps.dtype, device=logps.device).index_add(0, samples, logps)
        lengths = torch.bincount(samples, minlength=rows).to(logps.dtype)
        if ref is not None:
            ref = ref.detach().to(logps.device, logps.dtype)  # the reference is a constant
            ref_sums = torch.zeros_like(sums).index_add(0, samples, ref)
            sums, lengths, ref_sums = total(torch.stack([sums, lengths, ref_sums]), sequence).unbind(0)
        else:
            sums, lengths = total(torch.stack([sums, lengths]), sequence).unbind(0)
        empty = (lengths == 0).nonzero()
        if empty.numel():
            row = int(empty[0])
            side = "chosen" if row % 2 == 0 else "rejected"
            raise UserError(
                f"{self.name}: row {row} (the {side} side of pair {row // 2}) has no supervised token; "
                "every chosen and rejected row needs a labelled response"
            )
        pairs = Pairs(sums[0::2], sums[1::2], lengths[0::2], lengths[1::2])
        if ref is not None:
            pairs.ref_chosen, pairs.ref_rejected = ref_sums[0::2], ref_sums[1::2]
        return pairs


class SimPOLoss(PreferenceLoss):
    """SimPO (Meng et al. 2024, arXiv 2405.14734), reference-free: each row's reward is its
    length-normalised log-probability times ``beta``; per pair
    ``-log sigmoid(beta * (avg_chosen - avg_rejected) - gamma)`` (``gamma``: the target margin)."""

    def __init__(self, beta: float = 2.5, gamma: float = 0.5, ignore_index: int = -100):
        self.ignore_index = check_ignore_index(self.name, ignore_index)
        self.beta = check_positive(self.name, "beta", beta, 2.5)
        self.gamma = check_non_negative(self.name, "gamma", gamma)

    def pair_losses(self, pairs: Pairs) -> tuple[torch.Tensor, torch.Tensor]:
        margin = self.beta * (pairs.chosen / pairs.chosen_len - pairs.rejected / pairs.rejected_len)
        return -F.logsigmoid(margin - self.gamma), margin


class CPOLoss(PreferenceLoss):
    """CPO (Xu et al. 2024, arXiv 2401.08417), reference-free: per pair
    ``-log sigmoid(beta * (logp_chosen - logp_rejected))`` on the summed log-probabilities, plus
    ``bc_coef`` times the chosen row's mean token NLL (behaviour cloning)."""

    def __init__(self, beta: float = 0.1, bc_coef: float = 1.0, ignore_index: int = -100):
        self.ignore_index = check_ignore_index(self.name, ignore_index)
        self.beta = check_positive(self.name, "beta", beta, 0.1)
        self.bc_coef = check_non_negative(self.name, "bc_coef", bc_coef)

    def pair_losses(self, pairs: Pairs) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.beta * (pairs.chosen - pairs.rejected)
        return -F.logsigmoid(logits) + self.bc_coef * mean_nll(pairs.chosen, pairs.chosen_len), logits


class ORPOLoss(PreferenceLoss):
    """ORPO (Hong et al. 2024, arXiv 2403.07691), reference-free: with each row's mean token
    log-probability ``a`` and its odds ``a - log(1 - exp(a))``, per pair the chosen row's mean
    token NLL plus ``lambda_orpo`` times ``-log sigmoid(log odds_chosen - log odds_rejected)``."""

    def __init__(self, lambda_orpo: float = 0.1, ignore_index: int = -100):
        self.ignore_index = check_ignore_index(self.name, ignore_index)
        self.lambda_orpo = check_non_negative(self.name, "lambda_orpo", lambda_orpo)

    def pair_losses(self, pairs: Pairs) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = pairs.chosen / pairs.chosen_len
        rejected = pairs.rejected / pairs.rejected_len
        log_odds = (chosen - log1m_exp(chosen)) - (rejected - log1m_exp(rejected))
        nll = mean_nll(pairs.chosen, pairs.chosen_len)
        return nll - self.lambda_orpo * F.logsigmoid(log_odds), log_odds
