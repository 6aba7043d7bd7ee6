"""Advantages for policy-gradient RL: plain functions of the rewards of each prompt's group of
completions (``GRPOAdvantage``, ``RLOOAdvantage``), and their base ``Advantage``."""

from twinkle.advantage.base import Advantage
from twinkle.advantage.grpo import GRPOAdvantage
from twinkle.advantage.rloo import RLOOAdvantage

__all__ = ["Advantage", "GRPOAdvantage", "RLOOAdvantage"]
