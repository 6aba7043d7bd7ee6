"""``ClientMultiTurnRollout`` at upstream's import path: the multi-turn agentic rollout of
``twinkle_agentic`` (sample through the client, act in an environment, observe, sample again).

It is looked up when asked for, so importing ``twinkle_client`` does not import
``twinkle_agentic`` (which imports ``twinkle_client``'s sampler shapes itself)."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "ClientMultiTurnRollout":
        from twinkle_agentic.rollout import ClientMultiTurnRollout

        return ClientMultiTurnRollout
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
