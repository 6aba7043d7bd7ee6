"""Rewards for RL: a ``Reward`` maps trajectories (``{"messages": [...], "user_data": ...}``) to
one float each (``GSM8KAccuracyReward``, ``GSM8KFormatReward``)."""

from twinkle.reward.base import Reward, completion_of, ground_truth_of
from twinkle.reward.gsm8k import GSM8KAccuracyReward, GSM8KFormatReward, extract_answer

__all__ = [
    "Reward",
    "GSM8KAccuracyReward",
    "GSM8KFormatReward",
    "completion_of",
    "ground_truth_of",
    "extract_answer",
]
