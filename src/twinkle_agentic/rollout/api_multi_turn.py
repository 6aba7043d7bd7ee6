"""Upstream's module path of ``APIMultiTurnRollout``: it imports, and refuses in one line when
built (not supported yet)."""

from twinkle_agentic.unsupported import not_supported_yet

APIMultiTurnRollout = not_supported_yet(
    "APIMultiTurnRollout",
    "multi-turn tool rollouts through an OpenAI-compatible service (twinkle_agentic.protocol.OpenAI "
    "answers single requests); MultiTurnRollout runs them on a Twinkle sampler",
    "twinkle_agentic.rollout",
)

__all__ = ["APIMultiTurnRollout"]
