"""File names of a checkpoint folder, and the completion marker that makes it loadable.

<name>/
  adapter_config.json, adapter_model.safetensors   the LoRA adapter, PEFT format (full tensors)
  tokenizer files                                   so the folder is usable on its own
  trainer_state.json                                counters, data position, mesh, base model, loss class
  scheduler.pt                                      LR schedule position
  optimizer.pt                                      optimizer state (the same on every rank)
  rank_state_rank{r}.pt                             RNG states, open-window gradients and token count of rank r
  .twinkle-complete                                 written last: every other file's size and CRC-32
                                                    (``integrity``); without it the folder is ignored

Every file is read as data, never as code: JSON, safetensors, and ``torch.load(weights_only=True)``
for the ``.pt`` files (tensors and plain values only; ``load.read_state``). ``trainer_state.json``
is validated field by field before any value of it is used (``parse_trainer_state``).

A visible ``checkpoint-N`` or ``last-checkpoint`` folder without the marker was not written by
Twinkle: a save builds its folder under the hidden name ``.<name>.tmp`` and renames it into place
only with its marker, and rotation hides a folder before deleting it. Such a folder is never
resumed from, rotated away or replaced: a save to its name fails in one line
(``save.check_not_foreign``), and a run refuses at start-up an output dir whose
``last-checkpoint`` is one (``check_output_dir``), since every run of the contract script writes it.
"""

import json
import os
import re
from pathlib import Path
from typing import Any

from twinkle.checkpoint import integrity
from twinkle.utils.errors import UserError
from twinkle.utils.fileio import COMPLETE_MARKER, is_complete
from twinkle.utils.logger import get_logger

MARKER = COMPLETE_MARKER
TRAINER_STATE = "trainer_state.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
SCHEDULER = "scheduler.pt"
OPTIMIZER = "optimizer.pt"
# The training state a checkpoint holds beside the weights, by the adapter group's attribute:
# (its file, what messages call it). ``save.state_parts`` writes them, ``load.load_state_parts`` loads them.
STATE_PARTS = {"optimizer": (OPTIMIZER, "optimizer"), "lr_scheduler": (SCHEDULER, "LR schedule")}
LAST = "last-checkpoint"
FORMAT_VERSION = 1
STATE_FIX = "resume from another checkpoint or start afresh"
MAX_STATE_BYTES = 16 << 20  # a trainer state is a few KiB; a larger file is not one a save wrote
# Fields of trainer_state.json: ``cur_step`` orders the checkpoints and is required; the others
# are checked when present, and a resume then requires those it uses (``require_fields``).
REQUIRED_FIELDS = ("cur_step",)
ONLY_MODEL_FIELDS = ("cur_step", "optimizer_steps", "consumed_train_samples")
_COUNTS = (
    "optimizer_steps",
    "consumed_train_samples",
    "window_tokens",
    "window_batches",
    "skipped_steps",
    "nonfinite_steps",
    "format_version",
)
_POSITIVE = ("world_size", "gradient_accumulation_steps")
_FLOATS = ("last_grad_norm", "last_lr")
_TEXTS = ("adapter_name", "model_path", "base_model", "base_dtype", "loss")
RESUME_FIELDS = (*ONLY_MODEL_FIELDS, *_POSITIVE, *_COUNTS[2:6], *_FLOATS)
_CHECKPOINT_NAME = re.compile(r"checkpoint-\d+")


def rank_state_file(rank: int) -> str:
    return f"rank_state_rank{rank}.pt"


def is_checkpoint_name(name: str) -> bool:
    """``checkpoint-N`` and ``last-checkpoint``: the names the contract script saves under."""
    return name == LAST or _CHECKPOINT_NAME.fullmatch(name) is not None


def foreign_folders(output_dir: str | Path) -> list[Path]:
    """Visible ``checkpoint-N`` / ``last-checkpoint`` entries under ``output_dir`` without the
    completion marker: not written by Twinkle (see the module docstring), never replaced."""
    root = Path(output_dir).expanduser()
    if not root.is_dir():
        return []
    return sorted(
        entry
        for entry in root.iterdir()
        if is_checkpoint_name(entry.name) and not entry.is_symlink() and not is_complete(entry)
    )


def foreign_message(folder: Path) -> str:
    return (
        f"{folder} exists and was not written by Twinkle (no {MARKER}); Twinkle never replaces a "
        "folder it did not write: move it away or choose another --output-dir"
    )


def check_output_dir(output_dir: str | Path) -> None:
    """Raise ``UserError`` at start-up if checkpoints could not be written under ``output_dir``
    (its nearest existing ancestor is a file, or not writable) or its ``last-checkpoint`` is a
    folder Twinkle did not write, rather than after hours of training; warn about other foreign
    ``checkpoint-N`` folders (a save to one of those names fails). Creates nothing (the run's lock
    is ``initialize()``'s, ``twinkle.runtime.output_lock``)."""
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
    for folder in foreign_folders(path):
        if folder.name == LAST:
            raise UserError(foreign_message(folder))
        get_logger().warning(
            f"{folder} has no {MARKER}, so Twinkle did not write it: it is never resumed from, rotated "
            "or replaced, and a save under that name fails"
        )


def _field_problem(state: dict[str, Any]) -> str | None:
    """What is wrong with the fields of a parsed trainer state; None when nothing is."""

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def is_number(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)

    for name in REQUIRED_FIELDS:
        if name not in state:
            return f"no {name!r}"
    for name in (*REQUIRED_FIELDS, *_COUNTS, *_POSITIVE):
        value, least = state.get(name, 1), 1 if name in _POSITIVE else 0
        if not is_int(value) or value < least:
            return f"{name!r} is {json.dumps(value)[:40]}, expected an integer of at least {least}"
    for name in (*_FLOATS, "metric"):
        value = state.get(name)
        if value is not None and not is_number(value):
            return f"{name!r} is {json.dumps(value)[:40]}, expected a number"
    for name in _TEXTS:
        if not isinstance(state.get(name, ""), str):
            return f"{name!r} is {json.dumps(state[name])[:40]}, expected a string"
    mesh = state.get("mesh", [1, 1])
    if not (isinstance(mesh, list) and len(mesh) == 2 and all(is_int(v) and v >= 1 for v in mesh)):
        return f"'mesh' is {json.dumps(mesh)[:40]}, expected two positive integers"
    if not isinstance(state.get("lora", {}), dict):
        return "'lora' is not an object"
    if not isinstance(state.get("saved_optimizer", True), bool):
        return "'saved_optimizer' is not true or false"
    return None


def parse_trainer_state(folder: str | Path) -> dict[str, Any]:
    """``folder``'s ``trainer_state.json``, parsed as JSON and its fields checked (types and
    ranges of the counters, the strings, the mesh): ``UserError`` naming the file and what is
    wrong (cut short, not JSON, ``"cur_step": null``, a list, ...). Reads nothing else."""
    path = Path(folder) / TRAINER_STATE
    try:
        if path.stat().st_size > MAX_STATE_BYTES:
            raise ValueError(f"{path.stat().st_size} bytes, not a trainer state a save writes")
        state = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path} is missing; {STATE_FIX}") from None
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror or exc}); {STATE_FIX}") from None
    except (ValueError, RecursionError) as exc:
        reason = " ".join(str(exc).split())[:120] or type(exc).__name__
        raise UserError(f"{path} is not valid JSON ({reason}); {STATE_FIX}") from None
    problem = "it is not a JSON object" if not isinstance(state, dict) else _field_problem(state)
    if problem:
        raise UserError(f"{path} is not a trainer state Twinkle writes ({problem}); {STATE_FIX}")
    return state


def require_fields(folder: str | Path, state: dict[str, Any], names: tuple[str, ...]) -> None:
    """``UserError`` when ``state`` (parsed, checked) lacks a field a full resume uses."""
    missing = [name for name in names if name not in state]
    if missing:
        raise UserError(
            f"{Path(folder) / TRAINER_STATE} has no {missing[0]!r}, which a full resume needs; resume "
            "with --resume-only-model, from another checkpoint, or start afresh"
        )


def read_trainer_state(folder: str | Path) -> dict[str, Any]:
    """Validate that ``folder`` is a complete, intact checkpoint (every file the marker lists has
    its recorded size and checksum) and return its trainer state, its fields checked
    (``parse_trainer_state``). Every reader of a checkpoint calls this first, so a damaged or
    hand-edited file is one ``UserError`` before anything is read."""
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
    return parse_trainer_state(folder)


def _scan(output_dir: str | Path) -> tuple[list[tuple[int, float, Path]], list[tuple[Path, str]]]:
    """The complete visible checkpoints directly under ``output_dir``: (steps, marker time,
    folder) of those whose trainer state is valid, and (folder, what is wrong) of the others.
    Complete folders without a ``trainer_state.json`` are not checkpoints and left out."""
    root = Path(output_dir).expanduser()
    valid: list[tuple[int, float, Path]] = []
    invalid: list[tuple[Path, str]] = []
    if not root.is_dir():
        return valid, invalid
    for folder in sorted(root.iterdir()):
        if folder.name.startswith(".") or not is_complete(folder) or not (folder / TRAINER_STATE).exists():
            continue
        try:
            step = parse_trainer_state(folder)["cur_step"]
            valid.append((step, (folder / MARKER).stat().st_mtime, folder))
        except (UserError, OSError) as exc:
            report = integrity.check(folder, [TRAINER_STATE])
            problem = str(exc).removeprefix(f"{folder}/").removesuffix(f"; {STATE_FIX}")
            invalid.append((folder, report.describe() if not report.ok else problem))
    return sorted(valid, key=lambda item: item[:2]), invalid


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete checkpoint folders directly under ``output_dir`` whose trainer state is valid,
    oldest first: ordered by training steps, then by the time their save finished. Folders
    without the completion marker (interrupted saves, folders Twinkle did not write) and hidden
    folders (saves in progress) are left out."""
    return [folder for _, _, folder in _scan(output_dir)[0]]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete, intact checkpoint under ``output_dir`` with the most training steps (newest
    on a tie); None when there is no complete one. Folders without the completion marker
    (interrupted saves) are never chosen; one whose files no longer match their recorded size and
    checksum, or whose trainer state is not valid, is skipped with a warning naming the damage,
    and the next newest is tried. When every complete checkpoint is damaged this raises
    ``UserError`` rather than let a run start afresh over them."""
    valid, invalid = _scan(output_dir)
    for folder, problem in invalid:
        get_logger().warning(f"skipping checkpoint {folder}: {problem}; trying an earlier one")
    skipped = [folder for folder, _ in invalid]
    for _, _, folder in reversed(valid):
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
