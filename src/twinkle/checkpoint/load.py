"""Restore a checkpoint written by ``save_checkpoint``; every file is checked against the
completion marker's size and checksum before any of them is read (``integrity.verify``).

Every file is read onto the CPU (``read_state``): a checkpoint saved on GPU 0 would otherwise be
materialised on GPU 0 by every rank before its own copy is placed. The optimizer's
``load_state_dict`` moves its state to its parameters' device, the open window's gradients are
placed on each parameter's device, and RNG states are CPU tensors by definition."""

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from twinkle.checkpoint import integrity, layout
from twinkle.utils.errors import UserError


def read_state(path: Path, weights_only: bool = True) -> Any:
    """``torch.load`` of a checkpoint file, onto the CPU whatever device it was saved from."""
    return torch.load(path, map_location="cpu", weights_only=weights_only)


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy(), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_adapter_weights(model: Any, folder: Path, adapter_name: str) -> None:
    integrity.verify(folder, [layout.ADAPTER_WEIGHTS])
    _load_adapter_weights(model, folder, adapter_name)


def _load_adapter_weights(model: Any, folder: Path, adapter_name: str) -> None:
    from peft import set_peft_model_state_dict

    weights = load_file(folder / layout.ADAPTER_WEIGHTS, device="cpu")
    result = set_peft_model_state_dict(model, weights, adapter_name=adapter_name)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise UserError(f"checkpoint {folder} holds weights this model does not have (e.g. {unexpected[0]})")


def load_checkpoint(
    folder: Path, *, model: Any, adapter_name: str, group: Any, rank: int, only_model: bool
) -> dict:
    """Load weights (and, unless ``only_model``, optimizer, schedule, RNG). Returns this rank's
    open-window state for the caller to place: ``grads`` (name -> local gradient) and, in
    checkpoints that have it, ``window_tokens``; ``{}`` when ``only_model``.

    The files it reads are verified first (``read_trainer_state``, which a resume calls before,
    checks the whole folder), all of them before the model is touched: a damaged optimizer
    state fails the resume before the weights are replaced."""
    rank_file = folder / layout.rank_state_file(rank)
    reads = [layout.ADAPTER_WEIGHTS]
    if not only_model:
        reads += [rank_file.name, layout.OPTIMIZER, layout.SCHEDULER]
    integrity.verify(folder, reads)
    _load_adapter_weights(model, folder, adapter_name)
    if only_model:
        return {}
    if not rank_file.is_file():
        raise UserError(
            f"checkpoint {folder} has no state for rank {rank}; resume with the world size it was saved with"
        )
    rank_state = read_state(rank_file, weights_only=False)
    opt_file = folder / layout.OPTIMIZER
    if group.optimizer is not None and opt_file.is_file():
        group.optimizer.load_state_dict(read_state(opt_file))
    sched_file = folder / layout.SCHEDULER
    if group.lr_scheduler is not None and sched_file.is_file():
        group.lr_scheduler.load_state_dict(read_state(sched_file, weights_only=False))
    set_rng_state(rank_state["rng"])
    return {k: v for k, v in rank_state.items() if k != "rng"}
