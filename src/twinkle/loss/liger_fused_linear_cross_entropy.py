"""``LigerFusedLinearCrossEntropyLoss``: upstream's name for the fused head + cross-entropy.

On CUDA with ``liger-kernel`` installed it runs Liger's fused linear cross-entropy kernel;
elsewhere (no Liger, or a CPU/NPU tensor, which Liger's Triton kernel cannot take) it runs
``twinkle.loss.fused_linear_cross_entropy`` (chunked, hand-written gradients). The choice is
logged once per kernel. Liger returns no count of correct tokens, which the accuracy metric
needs: under Liger it is counted without gradients, one chunk of logits at a time. The loss
and gradients of both kernels equal plain cross-entropy's up to summation order."""

import importlib
import importlib.util
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

from twinkle.loss.base import LossView
from twinkle.loss.cross_entropy import IGNORE_INDEX, LossOutput, finish, top_is_target
from twinkle.loss.fused_linear_ce import FusedLinearCrossEntropyLoss, auto_chunk_rows
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()


@cache
def _liger_function() -> Callable | None:
    """Liger's functional fused linear cross-entropy, or None when ``liger-kernel`` (a release
    with ``liger_kernel.transformers.functional``) is absent."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    try:  # releases before the functional API have no such module
        module = importlib.import_module("liger_kernel.transformers.functional")
    except ImportError:
        return None
    return getattr(module, "liger_fused_linear_cross_entropy", None)


@cache
def _log_choice(kernel: str) -> None:
    logger.info("LigerFusedLinearCrossEntropyLoss runs %s", kernel)


def liger_kernel_for(hidden: torch.Tensor) -> Callable | None:
    """Liger's kernel where it can run ``hidden`` (installed, on CUDA), else None."""
    return _liger_function() if hidden.device.type == "cuda" else None


@torch.no_grad()
def count_correct(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_rows: int | None,
) -> torch.Tensor:
    """Rows whose target has the largest logit, one chunk of logits at a time."""
    rows = chunk_rows or auto_chunk_rows(weight.shape[0], hidden.device.type)
    correct = torch.zeros((), dtype=torch.long, device=hidden.device)
    for start in range(0, hidden.shape[0], rows):
        logits = F.linear(hidden[start : start + rows], weight, bias).float()
        correct += top_is_target(logits, targets[start : start + rows])
    return correct


class LigerFusedLinearCrossEntropyLoss(FusedLinearCrossEntropyLoss):
    """Upstream's constructor: ``ignore_index`` (-100 only: the model never scores a -100 label
    and scores every other), ``reduction`` (``sum``, the default, or ``mean``), ``label_smoothing``
    (0 only) and ``softcap`` (None only: a model whose config soft-caps its logits gets its loss
    from its own capped logits anyway). ``chunk_rows`` is ours (``fused_linear_cross_entropy``
    and the correct-token count under Liger)."""

    def __init__(
        self,
        ignore_index: int = IGNORE_INDEX,
        reduction: str = "sum",
        label_smoothing: float = 0.0,
        softcap: float | None = None,
        chunk_rows: int | None = None,
    ):
        for name, value, default in (
            ("ignore_index", ignore_index, IGNORE_INDEX),
            ("label_smoothing", label_smoothing, 0.0),
            ("softcap", softcap, None),
        ):
            if value != default:
                raise UserError(
                    f"LigerFusedLinearCrossEntropyLoss({name}={value!r}) is not supported yet: {name}; "
                    f"leave it at {default!r}"
                )
        super().__init__(reduction=reduction, chunk_rows=chunk_rows)
        self.ignore_index, self.label_smoothing, self.softcap = ignore_index, label_smoothing, softcap

    def compute(self, view: LossView) -> LossOutput:
        if view.hidden is None:  # logits or log-probabilities: plain cross-entropy
            return super().compute(view)
        hidden, weight, targets, bias = view.hidden, view.weight, view.targets, view.bias
        kernel = liger_kernel_for(hidden) if hidden.shape[0] else None
        if kernel is None:
            _log_choice("twinkle's chunked fused kernel (liger-kernel not installed or not on CUDA)")
            return super().compute(view)
        _log_choice("liger-kernel's fused linear cross-entropy")
        out = kernel(hidden, weight, targets, bias=bias, ignore_index=IGNORE_INDEX, reduction="sum")
        loss_sum = (out[0] if isinstance(out, tuple) else out).float()
        correct = count_correct(hidden, weight, targets, bias, self.chunk_rows)
        return finish(loss_sum, targets.numel(), correct, self.reduction)
