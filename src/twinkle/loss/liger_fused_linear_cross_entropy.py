"""``LigerFusedLinearCrossEntropyLoss``: upstream's name for the fused head + cross-entropy.

It runs ``twinkle.loss.fused_linear_cross_entropy`` (chunked, hand-written gradients) on every
device, whether or not ``liger-kernel`` is installed: Liger's Triton kernel needs CUDA and
returns no count of correct tokens, which the accuracy metric needs under the fused loss too.
The loss and gradients equal Liger's (and plain cross-entropy's) up to summation order."""

from twinkle.loss.cross_entropy import IGNORE_INDEX
from twinkle.loss.fused_linear_ce import FusedLinearCrossEntropyLoss
from twinkle.utils.errors import UserError


class LigerFusedLinearCrossEntropyLoss(FusedLinearCrossEntropyLoss):
    """Upstream's constructor: ``ignore_index`` (-100 only: the model never scores a -100 label
    and scores every other), ``reduction`` (``sum``, the default, or ``mean``), ``label_smoothing``
    (0 only) and ``softcap`` (None only: a model whose config soft-caps its logits gets its loss
    from its own capped logits anyway). ``chunk_rows`` is ours (``fused_linear_cross_entropy``)."""

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
