"""``SAPOLoss``: Soft Adaptive Policy Optimization (Gao et al. 2025, arXiv 2511.20347), GRPO with
the hard clip replaced by a smooth gate.

Per completion token ``t`` with ``ratio_t = exp(logp_t - old_t)`` and the row's advantage ``A``,
``tau = tau_pos`` where ``A > 0`` and ``tau_neg`` otherwise:

    gate_t = sigmoid(tau * (ratio_t - 1)) * 4 / tau
    term_t = -gate_t * A                      (+ beta * KL_k3 to the reference, as GRPOLoss)

The gate's slope in the ratio is ``4 * s * (1 - s)`` with ``s = sigmoid(tau * (ratio_t - 1))``:
1 at ``ratio_t = 1`` (the plain policy gradient on-policy), falling smoothly as the ratio drifts,
so a token far off-policy keeps a small gradient instead of none (a clip's cliff). A larger
``tau`` narrows the gate; the paper damps negative advantages harder (``tau_neg > tau_pos``).
Like ``GRPOLoss``: the mean over each completion's tokens, then the mean over completions.
``epsilon``/``epsilon_high`` bound nothing here; they are kept for upstream's call shape."""

import torch

from twinkle.loss.grpo import GRPOLoss, _check

DAMPED = 0.5  # a token counts as damped where the gate's slope is below this


class SAPOLoss(GRPOLoss):
    """See the module docstring. ``num_correct`` counts, per completion, the share of its tokens
    whose gate slope is below 1/2 (the soft counterpart of a clipped token), summed over
    completions; the model reports it as ``damped_fraction``."""

    correct_metric = "damped_fraction"

    def __init__(
        self,
        epsilon: float = 0.2,
        beta: float = 0.0,
        tau_pos: float = 1.0,
        tau_neg: float = 1.0,
        ignore_index: int = -100,
        epsilon_high: float | None = None,
        entropy_coef: float = 0.0,
    ):
        super().__init__(epsilon, epsilon_high, beta, entropy_coef, ignore_index)
        self.tau_pos = _check(self.name, "tau_pos", tau_pos, strict=True)
        self.tau_neg = _check(self.name, "tau_neg", tau_neg, strict=True)

    def _gate(
        self, logps: torch.Tensor, old: torch.Tensor, adv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the gate's value, its slope in the ratio) per token."""
        ratio = torch.exp((logps - old).clamp(-20.0, 20.0))
        tau = torch.where(adv > 0, self.tau_pos, self.tau_neg).to(ratio.dtype)
        s = torch.sigmoid(tau * (ratio - 1))
        return s * 4 / tau, 4 * s * (1 - s)

    def token_terms(self, logps: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        return -self._gate(logps, old, adv)[0] * adv

    def clipped(self, logps: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        return self._gate(logps, old, adv)[1] < DAMPED
