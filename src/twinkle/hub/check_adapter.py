"""``check_adapter_folder``: find what makes a saved LoRA adapter unloadable before PEFT reads it.

PEFT builds the LoRA layers from ``adapter_config.json`` and then copies the saved tensors in; a
config whose rank ``r`` is not the rank of the tensors (a config edited by hand, or copied from
another run) fails there with a ``size mismatch`` line per tensor. Here the two are compared from
the config and the safetensors header alone (no tensor is read), and the first difference becomes
one ``UserError`` line."""

import json
import re
from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# The dimension of each LoRA tensor that is the rank: A is (r, in, ...), B is (out, r, ...);
# embedding adapters keep the same layout under their own names.
_RANK_DIM = ((re.compile(r"\.lora_(embedding_)?A(\.|$)"), 0), (re.compile(r"\.lora_(embedding_)?B(\.|$)"), 1))


def _fail(folder: Path, text: str) -> UserError:
    return UserError(f"adapter {folder}: {text}")


def read_adapter_config(folder: Path) -> dict[str, Any]:
    """``adapter_config.json`` as a dict; a missing, unreadable or non-object file is an error."""
    path = folder / CONFIG
    if not path.is_file():
        raise _fail(folder, f"no {CONFIG}; pass a checkpoint folder written by model.save(...)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(
            folder, f"{CONFIG} cannot be read ({exc}); restore it from the run that saved it"
        ) from None
    if not isinstance(config, dict):
        raise _fail(folder, f"{CONFIG} holds a {type(config).__name__}, not a JSON object; restore it")
    return config


def _ranks(config: dict[str, Any]) -> set[int]:
    """The ranks the config allows: ``r``, and any per-module rank of ``rank_pattern``."""
    ranks = {config.get("r")}
    pattern = config.get("rank_pattern")
    if isinstance(pattern, dict):
        ranks |= set(pattern.values())
    return {r for r in ranks if isinstance(r, int) and not isinstance(r, bool)}


def _weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    try:
        with safe_open(str(folder / WEIGHTS), framework="pt") as handle:
            return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except Exception as exc:  # safetensors raises its own SafetensorError, or OSError
        reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        raise _fail(
            folder, f"{WEIGHTS} is damaged or cut short ({reason}); copy the checkpoint again"
        ) from None


def check_adapter_folder(folder: str | Path) -> dict[str, Any]:
    """Raise one ``UserError`` line when ``folder``'s LoRA tensors do not have the rank its
    ``adapter_config.json`` gives (``r``, or a ``rank_pattern`` rank); return the config. A folder
    without ``adapter_model.safetensors`` (PEFT's older ``.bin``) has only its config checked."""
    folder = Path(folder).expanduser()
    config = read_adapter_config(folder)
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _fail(folder, f"{CONFIG} has r {r!r}, which must be a positive integer; restore it")
    if not (folder / WEIGHTS).is_file():
        return config
    ranks = _ranks(config)
    for key, shape in _weight_shapes(folder).items():
        for pattern, dim in _RANK_DIM:
            if pattern.search(key) and len(shape) > dim and shape[dim] not in ranks:
                raise _fail(
                    folder,
                    f"{CONFIG} says r={r} but the weights have rank {shape[dim]} ({key} is {list(shape)}); "
                    f"use the {CONFIG} saved with these weights",
                )
    return config
