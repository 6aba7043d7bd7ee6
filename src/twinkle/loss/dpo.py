"""``DPOLoss``: Direct Preference Optimization (Rafailov et al. 2023, arXiv 2305.18290) and its
hinge and IPO variants, on interleaved pairs of rows (``twinkle.loss.preference``).

The reference is the model's own base (``ref = model.forward_only(inputs=batch,
disable_lora=True)``) or any model's ``forward_only`` outputs on the same batch:
``model.forward_backward(inputs=batch, ref_outputs=ref)`` hands its per-label log-probabilities
to the loss as the batch input ``ref_logps``. Or ``model.set_loss("DPOLoss", beta=0.1)``."""

import torch
import torch.nn.functional as F

from twinkle.loss.preference import Pairs, PreferenceLoss, check_non_negative, check_positive, mean_nll
from twinkle.loss.upstream_keywords import check_ignore_index
from twinkle.utils.errors import UserError

LOSS_TYPES = ("sigmoid", "hinge", "ipo")


class DPOLoss(PreferenceLoss):
    """Per pair, with ``d = (logp_chosen - ref_chosen) - (logp_rejected - ref_rejected)`` on the
    rows' summed log-probabilities (``reference_free``: the reference terms are 0):

    - ``sigmoid``: ``-log sigmoid(beta * d)``; with ``label_smoothing`` ``e`` (conservative DPO,
      the preference taken as wrong with probability ``e``):
      ``-(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d)``;
    - ``hinge`` (SLiC): ``max(0, 1 - beta * d)``;
    - ``ipo`` (Azar et al. 2023, arXiv 2310.12036): ``(d - 1 / (2 beta))^2``;

    plus ``sft_weight`` times the chosen row's mean token NLL. At the reference itself (LoRA's B
    still 0) ``d`` is 0: ``ln 2``, ``1`` and ``(1 / (2 beta))^2``. The implicit rewards are
    ``beta * (logp - ref)``; a pair counts as correct when ``beta * d > 0``."""

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        reference_free: bool = False,
        sft_weight: float = 0.0,
        ignore_index: int = -100,
    ):
        self.ignore_index = check_ignore_index(self.name, ignore_index)
        self.beta = check_positive(self.name, "beta", beta, 0.1)
        if loss_type == "kto_pair":  # upstream's name; its pairwise KTO is not built here
            raise UserError("DPOLoss: not supported yet: loss_type='kto_pair'; use sigmoid, hinge or ipo")
        if loss_type not in LOSS_TYPES:
            raise UserError(f"DPOLoss: unknown loss_type {loss_type!r}; valid types: {', '.join(LOSS_TYPES)}")
        self.loss_type = loss_type
        smoothing = check_non_negative(self.name, "label_smoothing", label_smoothing)
        if smoothing >= 0.5 or (smoothing and loss_type != "sigmoid"):
            raise UserError(
                f"DPOLoss: label_smoothing={label_smoothing!r} needs loss_type='sigmoid' and a value "
                "below 0.5 (the probability that a pair's preference is wrong)"
            )
        self.label_smoothing = smoothing
        self.reference_free = bool(reference_free)
        self.sft_weight = check_non_negative(self.name, "sft_weight", sft_weight)
        self.extra_inputs = () if self.reference_free else ("ref_logps",)

    def pair_losses(self, pairs: Pairs) -> tuple[torch.Tensor, torch.Tensor]:
        d = pairs.chosen - pairs.rejected
        if not self.reference_free:
            d = d - (pairs.ref_chosen - pairs.ref_rejected)
        logits = self.beta * d
        if self.loss_type == "sigmoid":
            losses = -F.logsigmoid(logits)
            if self.label_smoothing:
                e = self.label_smoothing
                losses = (1 - e) * losses - e * F.logsigmoid(-logits)
        elif self.loss_type == "hinge":
            losses = torch.relu(1 - logits)
        else:
            losses = (d - 1 / (2 * self.beta)) ** 2
        if self.sft_weight:
            losses = losses + self.sft_weight * mean_nll(pairs.chosen, pairs.chosen_len)
        return losses, logits
