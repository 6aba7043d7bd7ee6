"""Upstream's module path of ``MultiTurnCondenseRollout``: it imports, and refuses in one line
when built (not supported yet)."""

from twinkle_agentic.unsupported import not_supported_yet

MultiTurnCondenseRollout = not_supported_yet(
    "MultiTurnCondenseRollout",
    "multi-turn rollouts whose context a condenser shortens between turns; MultiTurnRollout "
    "(twinkle_agentic.rollout) runs without one",
    __name__,
)

__all__ = ["MultiTurnCondenseRollout"]
