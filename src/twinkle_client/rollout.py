"""``ClientMultiTurnRollout``: upstream's multi-turn agentic rollout driven through the client
(sample, act in an environment, observe, sample again). Not served yet: building it refuses in
one line, so an upstream script gets past its imports and learns what is missing."""

from typing import Any


class ClientMultiTurnRollout:
    def __init__(self, *args: Any, **kwargs: Any):
        raise NotImplementedError(
            "ClientMultiTurnRollout: not supported yet: multi-turn agentic rollouts through "
            "twinkle_client are a later issue (twinkle_agentic)"
        )


__all__ = ["ClientMultiTurnRollout"]
