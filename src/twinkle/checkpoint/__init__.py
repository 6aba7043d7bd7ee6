"""Checkpoints on disk: complete or absent, never torn.

Public names: ``save_checkpoint``, ``load_checkpoint``, ``is_complete``, ``latest_checkpoint``, ``read_trainer_state``."""

from twinkle.checkpoint.layout import is_complete, latest_checkpoint, read_trainer_state
from twinkle.checkpoint.load import load_checkpoint
from twinkle.checkpoint.save import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "is_complete", "latest_checkpoint", "read_trainer_state"]
