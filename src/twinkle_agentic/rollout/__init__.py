"""Multi-turn rollouts: the model samples, calls tools, reads their results, and samples again.

Public names: ``Rollout``, ``MultiTurnRollout``, ``ClientMultiTurnRollout``, ``RolloutMetrics``,
``Episode``, ``LAST_TURN_NOTICE``; ``APIMultiTurnRollout`` and
``multi_turn_condense.MultiTurnCondenseRollout`` (upstream's names) import and refuse in one line
when built."""

from twinkle_agentic.rollout.api_multi_turn import APIMultiTurnRollout
from twinkle_agentic.rollout.base import Rollout
from twinkle_agentic.rollout.client import ClientMultiTurnRollout
from twinkle_agentic.rollout.metrics import RolloutMetrics
from twinkle_agentic.rollout.multi_turn import LAST_TURN_NOTICE, MultiTurnRollout
from twinkle_agentic.rollout.state import Episode

__all__ = [
    "Rollout",
    "MultiTurnRollout",
    "ClientMultiTurnRollout",
    "RolloutMetrics",
    "Episode",
    "LAST_TURN_NOTICE",
    "APIMultiTurnRollout",
]
