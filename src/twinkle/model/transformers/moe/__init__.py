"""Mixture-of-experts names upstream's scripts import: ``router_replay.RouterReplayAction``."""
