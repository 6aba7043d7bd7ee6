"""Upstream's OlympiadBench reward names (``OlympiadBenchAccuracyReward``,
``OlympiadBenchFormatReward``, ``OlympiadBenchQualityReward``), imported by its multimodal GRPO
cookbook (``rl/grpo/grpo_mm.py``). Not built yet: each constructor says so in one line, so the
script gets past its imports and stops at the first reward it builds."""

from typing import Any

from twinkle.reward.base import Reward
from twinkle.utils.errors import UserError


class _NotYet(Reward):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise UserError(
            f"{type(self).__name__}: not supported yet: OlympiadBench rewards (with multimodal GRPO, "
            "rl/grpo/grpo_mm.py); score with GSM8KAccuracyReward or a Reward of your own"
        )


class OlympiadBenchAccuracyReward(_NotYet):
    """The answer's correctness against the ground truth."""


class OlympiadBenchFormatReward(_NotYet):
    """The answer's form (one boxed final answer)."""


class OlympiadBenchQualityReward(_NotYet):
    """The reasoning's quality (length, repetition)."""
