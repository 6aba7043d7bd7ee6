"""Rewards for question answering with tools.

Public names: ``F1Reward`` (token F1 of the final ``\\boxed{}`` answer against the trajectory's
ground truth), ``CoTReward`` (a bonus for a boxed answer reached in numbered steps),
``ToolExploreReward`` (a bonus for answering right after tool calls that returned something);
``twinkle_agentic.reward.f1`` also has ``_f1_score`` and ``_extract_final_answer``, the helpers
upstream's scripts import."""

from twinkle_agentic.reward.f1 import CoTReward, F1Reward, ToolExploreReward

__all__ = ["F1Reward", "CoTReward", "ToolExploreReward"]
