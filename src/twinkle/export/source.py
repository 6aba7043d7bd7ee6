"""What an export reads: a checkpoint's LoRA adapter and the base model it was trained on.

A Twinkle checkpoint records its base twice in ``trainer_state.json``: ``model_path``, the
local folder the weights were loaded from (for a GGUF base, its converted cache folder), and
``base_model``, the id the user gave. The folder is tried first because it is exactly what was
trained; the id is resolved again when the folder is gone (a cleared cache re-converts a GGUF).
A plain PEFT adapter folder has no trainer state; its ``adapter_config.json`` names the base."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle.checkpoint.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS, TRAINER_STATE, read_trainer_state
from twinkle.hub import resolve_model
from twinkle.utils.errors import UserError

BUNDLED_PREFIX = "bundled:"


@dataclass(frozen=True)
class ExportSource:
    """``adapter_dir``: the checkpoint folder. ``base_dir``: a local folder
    ``from_pretrained`` loads. ``base_id``: how the base was named, for messages."""

    adapter_dir: Path
    base_dir: Path
    base_id: str


def _check_adapter(folder: Path, given: str) -> None:
    if not folder.exists():
        raise UserError(f"checkpoint {given} does not exist; pass a checkpoint folder to --adapter")
    if not folder.is_dir():
        raise UserError(
            f"{given} is a file; pass a checkpoint folder (written by model.save(...)) to --adapter"
        )
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise UserError(
            f"{given} holds no LoRA adapter ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}); "
            "pass a checkpoint folder written by model.save(...) to --adapter"
        )


def _recorded_base(folder: Path) -> tuple[list[str | None], str]:
    """The ids to try, in order (None: the bundled model), and the name to report."""
    if (folder / TRAINER_STATE).is_file():
        state: dict[str, Any] = read_trainer_state(folder)  # a damaged checkpoint is refused here
        recorded = str(state.get("base_model") or "")
        candidates: list[str | None] = []
        path = state.get("model_path")
        if path and (Path(path) / "config.json").is_file():
            candidates.append(str(path))
        if recorded.startswith(BUNDLED_PREFIX):
            candidates.append(None)
        elif recorded:
            candidates.append(recorded)
        return candidates, recorded or str(path)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    recorded = config.get("base_model_name_or_path") or ""
    return ([recorded] if recorded else []), recorded


def find_source(adapter: str, model_id: str | None = None) -> ExportSource:
    """The adapter folder and its base; ``UserError`` for a folder without an adapter, a damaged
    checkpoint, or a base that cannot be found (``model_id`` overrides the recorded base)."""
    folder = Path(adapter).expanduser().absolute()
    _check_adapter(folder, adapter)
    if model_id is not None:
        return ExportSource(folder, resolve_model(model_id), model_id)
    candidates, recorded = _recorded_base(folder)
    if not candidates:
        raise UserError(f"{adapter} does not record its base model; pass it with --model-id")
    reason = ""
    for candidate in candidates:
        try:
            return ExportSource(folder, resolve_model(candidate), recorded)
        except UserError as exc:
            reason = str(exc).split(";")[0]  # what is wrong, without the hint for --model-id
    raise UserError(f"the base model of {adapter} cannot be found ({reason}); pass it with --model-id")
