"""Checkpoints on disk: complete or absent, never torn.

Public names: ``save_checkpoint``, ``load_checkpoint``, ``is_complete``, ``latest_checkpoint``,
``complete_checkpoints``, ``read_trainer_state``, ``rotate_checkpoints``, ``best_checkpoint``, ``check_output_dir``."""

from twinkle.checkpoint.layout import (
    check_output_dir,
    complete_checkpoints,
    is_complete,
    latest_checkpoint,
    read_trainer_state,
)
from twinkle.checkpoint.load import load_checkpoint
from twinkle.checkpoint.rotate import best_checkpoint, rotate_checkpoints
from twinkle.checkpoint.save import save_checkpoint

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "is_complete",
    "latest_checkpoint",
    "complete_checkpoints",
    "read_trainer_state",
    "rotate_checkpoints",
    "best_checkpoint",
    "check_output_dir",
]
