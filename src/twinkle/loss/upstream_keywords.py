"""Upstream's loss keywords that every loss here takes by name and honours only at their
defaults: ``ignore_index`` (labels are -100 where no target is, everywhere in Twinkle, so
another value would mark nothing) and ``entropy_coef`` (an entropy bonus needs each token's
entropy over the whole vocabulary, which the model's fused head never builds)."""

from typing import Any

from twinkle.loss.output import IGNORE_INDEX
from twinkle.utils.errors import UserError


def check_ignore_index(loss: str, ignore_index: Any) -> int:
    if ignore_index != IGNORE_INDEX or isinstance(ignore_index, bool):
        raise UserError(
            f"{loss}: not supported yet: ignore_index={ignore_index!r} (labels use {IGNORE_INDEX} where no target is)"
        )
    return IGNORE_INDEX


def check_upstream_keywords(loss: str, entropy_coef: Any, ignore_index: Any) -> tuple[float, int]:
    """``(entropy_coef, ignore_index)`` when they are the defaults (0 and -100), else a one-line
    ``UserError`` naming the keyword."""
    if entropy_coef != 0 or isinstance(entropy_coef, bool):
        raise UserError(
            f"{loss}: not supported yet: entropy_coef={entropy_coef!r} (the model computes no per-token "
            "entropy); leave it at 0"
        )
    return 0.0, check_ignore_index(loss, ignore_index)
