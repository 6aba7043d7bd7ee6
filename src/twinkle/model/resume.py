"""Checks that a checkpoint can continue this run, before anything is loaded."""

import warnings
from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()


def check_resumable(folder: Path, saved: dict[str, Any], current: dict[str, Any], only_model: bool) -> None:
    """``saved`` is the checkpoint's trainer state, ``current`` the same fields for this run."""
    if saved.get("lora", current["lora"]) != current["lora"]:
        raise UserError(
            f"checkpoint {folder} was trained with {_training_kind(saved['lora'], 'LoRA ')}, this run uses "
            f"{_training_kind(current['lora'])}; use the same LoRA flags"
        )
    same_model = saved.get("base_model") == current["base_model"] or (
        saved.get("model_path") is not None and saved.get("model_path") == current["model_path"]
    )
    if not same_model:
        raise UserError(f"checkpoint {folder} was trained on {saved.get('base_model')}; pass that --model-id")
    if saved.get("base_dtype", current["base_dtype"]) != current["base_dtype"]:
        dtype = saved["base_dtype"].removeprefix("torch.")
        logger.warning(
            f"checkpoint {folder} was trained on {dtype} base weights, this run has "
            f"{current['base_dtype'].removeprefix('torch.')}; it continues with other numerics "
            f"(pass --dtype {dtype} to keep them)"
        )
    if only_model:
        return
    if saved["world_size"] != current["world_size"] or saved.get("mesh", current["mesh"]) != current["mesh"]:
        raise UserError(
            f"checkpoint {folder} was saved by {saved['world_size']} process(es) on mesh (dp, fsdp) = "
            f"{tuple(saved.get('mesh', ()))}, this job has {current['world_size']} on {tuple(current['mesh'])}; "
            "resume with the same world size and mesh (--fsdp-size/--dp-size), or pass --resume-only-model"
        )
    if saved["gradient_accumulation_steps"] != current["gradient_accumulation_steps"]:
        raise UserError(
            f"checkpoint {folder} was saved with --gradient-accumulation-steps {saved['gradient_accumulation_steps']}, "
            f"this run uses {current['gradient_accumulation_steps']}; use the same value or pass --resume-only-model"
        )
    if not saved.get("saved_optimizer", True):
        logger.warning(f"checkpoint {folder} holds no optimizer state; the optimizer restarts from scratch")


def _training_kind(lora: dict, prefix: str = "") -> str:
    return f"{prefix}{lora}" if lora else "every weight (full-parameter, no adapter)"


def fast_forward_scheduler(scheduler: Any, optimizer_steps: int) -> None:
    """Advance a fresh schedule by ``optimizer_steps`` (a weights-only resume keeps the step count,
    so the learning rate must continue from there, not restart its warm-up)."""
    if scheduler is None:
        return
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": intended here
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(optimizer_steps):
            scheduler.step()
