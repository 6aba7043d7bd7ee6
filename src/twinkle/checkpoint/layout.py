"""File names of a checkpoint folder, and the completion marker that makes it loadable.

<name>/
  adapter_config.json, adapter_model.safetensors   the LoRA adapter, PEFT format (full tensors)
  tokenizer files                                   so the folder is usable on its own
  trainer_state.json                                counters, data position, mesh, base model
  scheduler.pt                                      LR schedule position
  optimizer.pt                                      optimizer state (the same on every rank)
  rank_state_rank{r}.pt                             RNG states, open-window gradients and token count of rank r
  .twinkle-complete                                 written last: every other file's size and CRC-32
                                                    (``integrity``); without it the folder is ignored
"""

import json
import os
from pathlib import Path
from typing import Any

from twinkle.checkpoint import integrity
from twinkle.runtime import output_lock
from twinkle.utils.errors import UserError
from twinkle.utils.fileio import COMPLETE_MARKER, is_complete
from twinkle.utils.logger import get_logger

MARKER = COMPLETE_MARKER
TRAINER_STATE = "trainer_state.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
SCHEDULER = "scheduler.pt"
OPTIMIZER = "optimizer.pt"
FORMAT_VERSION = 1


def rank_state_file(rank: int) -> str:
    return f"rank_state_rank{rank}.pt"


def check_output_dir(output_dir: str | Path) -> None:
    """Raise ``UserError`` at start-up if checkpoints could not be written under ``output_dir``
    (its nearest existing ancestor is a file, or not writable), rather than after hours of
    training. Creates nothing; the folder becomes the one ``initialize()`` locks for this run
    when the run defaults name it next (``twinkle.runtime.output_lock``)."""
    path = Path(output_dir).expanduser().absolute()
    existing = next(folder for folder in (path, *path.parents) if folder.exists())
    if not existing.is_dir():
        raise UserError(
            f"--output-dir {output_dir}: {existing} is a file, not a folder; choose another --output-dir"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(
            f"--output-dir {output_dir}: {existing} is not writable; choose a writable --output-dir"
        )
    output_lock.expect(output_dir)


def read_trainer_state(folder: str | Path) -> dict[str, Any]:
    """Validate that ``folder`` is a complete, intact checkpoint (every file the marker lists has
    its recorded size and checksum) and return its trainer state. Every reader of a checkpoint
    calls this first, so a damaged file is one ``UserError`` before anything is read."""
    folder = Path(folder)
    if not folder.exists():
        raise UserError(f"checkpoint {folder} does not exist; check --resume-from-checkpoint")
    if not (folder / TRAINER_STATE).is_file() and not (folder / MARKER).exists():
        raise UserError(
            f"{folder} is not a Twinkle checkpoint (no {TRAINER_STATE}); point to a checkpoint folder"
        )
    if not is_complete(folder):
        raise UserError(
            f"checkpoint {folder} is incomplete (its save was interrupted); resume from an earlier one"
        )
    integrity.verify(folder)
    return json.loads((folder / TRAINER_STATE).read_text())


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete checkpoint folders directly under ``output_dir``, oldest first: ordered by
    training steps, then by the time their save finished. Folders without the completion marker
    (interrupted saves) and hidden folders (saves in progress) are left out."""
    root = Path(output_dir).expanduser()
    if not root.is_dir():
        return []
    found: list[tuple[int, float, Path]] = []
    for folder in root.iterdir():
        if folder.name.startswith(".") or not is_complete(folder):
            continue
        try:
            step = int(json.loads((folder / TRAINER_STATE).read_text())["cur_step"])
            found.append((step, (folder / MARKER).stat().st_mtime, folder))
        except (OSError, ValueError, KeyError):
            continue
    return [folder for _, _, folder in sorted(found, key=lambda item: item[:2])]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete, intact checkpoint under ``output_dir`` with the most training steps (newest
    on a tie); None when there is no complete one. Folders without the completion marker
    (interrupted saves) are never chosen; one whose files no longer match their recorded size and
    checksum is skipped with a warning naming the damage, and the next newest is tried. When every
    complete checkpoint is damaged this raises ``UserError`` rather than let a run start afresh
    over them."""
    folders = complete_checkpoints(output_dir)
    skipped = []
    for folder in reversed(folders):
        report = integrity.check(folder)
        if report.ok:
            if not report.verified:
                integrity.log_unverified(folder)
            return folder
        skipped.append(folder)
        get_logger().warning(f"skipping checkpoint {folder}: {report.describe()}; trying an earlier one")
    if skipped:
        raise UserError(
            f"every complete checkpoint under {output_dir} is damaged (`twinkle verify {output_dir}` says "
            "what is wrong); move them away to start afresh"
        )
    return None
