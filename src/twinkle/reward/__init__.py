"""Rewards for RL: a ``Reward`` maps trajectories (``{"messages": [...], "user_data": ...}``) to
one float each (``GSM8KAccuracyReward``, ``GSM8KFormatReward``; OlympiadBench's accuracy, format
and quality)."""

from twinkle.reward.base import Reward, completion_of, ground_truth_of
from twinkle.reward.gsm8k import GSM8KAccuracyReward, GSM8KFormatReward, extract_answer
from twinkle.reward.olympiad_bench import (
    OlympiadBenchAccuracyReward,
    OlympiadBenchFormatReward,
    OlympiadBenchQualityReward,
)

__all__ = [
    "Reward",
    "GSM8KAccuracyReward",
    "GSM8KFormatReward",
    "OlympiadBenchAccuracyReward",
    "OlympiadBenchFormatReward",
    "OlympiadBenchQualityReward",
    "completion_of",
    "ground_truth_of",
    "extract_answer",
]
