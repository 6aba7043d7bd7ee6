"""Upstream's ``twinkle.model.transformers`` path, kept for the names its scripts import from it:
``moe.router_replay.RouterReplayAction``. The Transformers model itself is
``twinkle.model.TransformersModel``."""
