"""``RouterReplayAction``: what a step asks of MoE routing replay (record each token's chosen
experts, or replay recorded ones), under upstream's names and values.

Routing replay itself is not built: ``TransformersModel(enable_router_replay=True)`` is refused
in one line, and on a model built without it a step's ``router_replay_action`` has nothing to act
on (as upstream's model ignores it there); the step says so once (``twinkle.model.loss_inputs``)."""

from enum import Enum


class RouterReplayAction(Enum):
    RECORD = "record"  # keep each token's chosen experts during the forward
    REPLAY_FORWARD = "replay_forward"  # route each token to the recorded experts
    REPLAY_BACKWARD = "replay_backward"  # the same routes again when a layer is recomputed in backward
