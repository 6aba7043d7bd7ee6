"""Checkpoints on disk: complete or absent, never torn, checked before they are read.

Public names: ``save_checkpoint``, ``load_checkpoint``, ``is_complete``, ``latest_checkpoint``,
``complete_checkpoints``, ``read_trainer_state``, ``rotate_checkpoints``, ``best_checkpoint``,
``check_output_dir``, ``check_checkpoint`` (a ``Report`` of damaged files), ``verify_checkpoint``
(a ``UserError`` on the first)."""

from twinkle.checkpoint.integrity import check as check_checkpoint
from twinkle.checkpoint.integrity import verify as verify_checkpoint
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
    "check_checkpoint",
    "verify_checkpoint",
]
