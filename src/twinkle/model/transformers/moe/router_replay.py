"""``RouterReplayAction``: what a step asks of MoE routing replay (record each token's chosen
experts, or replay recorded ones), under upstream's names and values.

A model built with ``TransformersModel(enable_router_replay=True)`` acts on it
(``twinkle.model.router_replay``); on a model built without it a step's ``router_replay_action``
has nothing to act on (as upstream's model ignores it there); the step says so once
(``twinkle.model.loss_inputs``)."""

from enum import Enum


class RouterReplayAction(Enum):
    RECORD = "record"  # keep each token's chosen experts during the forward
    REPLAY_FORWARD = "replay_forward"  # route each token to the recorded experts
    # the same routes again when a layer is recomputed in backward: the routes a forward was
    # armed with stay for its backward, so this replays as REPLAY_FORWARD does
    REPLAY_BACKWARD = "replay_backward"
