"""Restore a checkpoint written by ``save_checkpoint``; every file is checked against the
completion marker's size and checksum before any of them is read (``integrity.verify``).

Every ``.pt`` file is read as data (``read_state``: ``torch.load(weights_only=True)``, tensors and
plain values only), so a file that would run code when unpickled is refused in one line naming it,
whatever its checksum says; nothing in a checkpoint is ever executed. All of them are read and
checked before the model is touched, so a refused file leaves the weights as they were.

Every file is read onto the CPU: a checkpoint saved on GPU 0 would otherwise be materialised on
GPU 0 by every rank before its own copy is placed. The optimizer's ``load_state_dict`` moves its
state to its parameters' device, the open window's gradients are placed on each parameter's
device, and RNG states are CPU tensors by definition."""

import pickle
import random
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from twinkle.checkpoint import integrity, layout
from twinkle.utils.errors import UserError

DATA_FIX = (
    "Twinkle reads checkpoint files as data and runs nothing in them; resume from a checkpoint "
    "Twinkle wrote, or start afresh"
)


def _unsafe_names(path: Path) -> str:
    """The code a pickle would call (``posix.system``), found without running it; "" if none."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a torch.save zip: the caller reports that instead
        return ""
    return f": it calls {', '.join(names[:3])}" if names else ""


def read_state(path: Path, *, mmap: bool = False) -> Any:
    """``torch.load`` of a checkpoint file as data (tensors and plain values only), onto the CPU
    whatever device it was saved from; ``UserError`` naming the file when it holds anything else
    or is not a file ``torch.save`` wrote. ``mmap`` maps the tensors instead of reading them."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        raise UserError(
            f"{path} holds more than tensors and plain values{_unsafe_names(path)}; {DATA_FIX}"
        ) from None
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as exc:
        reason = " ".join(str(exc).split())[:120] or type(exc).__name__
        raise UserError(f"{path} is not a file torch.save wrote ({reason}); {DATA_FIX}") from None


def data_problem(path: Path) -> str | None:
    """What is wrong with the ``.pt`` file ``path`` as data (the ``read_state`` message without
    the path); None when it loads as tensors and plain values. Maps rather than reads tensors."""
    try:
        read_state(path, mmap=True)
    except UserError as exc:
        return str(exc).removeprefix(f"{path} ")
    return None


def _refuse(path: Path, what: str) -> UserError:
    return UserError(f"{path} is not the {what} a Twinkle save writes; {DATA_FIX}")


def read_rank_state(path: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """A rank's state (``rng``, ``grads``, ``window_tokens``), its structure checked: every
    gradient is of a parameter in ``shapes`` (name -> this rank's local shape) and of its shape."""
    state = read_state(path)
    rng = state.get("rng") if isinstance(state, dict) else None
    grads = state.get("grads", {}) if isinstance(state, dict) else None
    tokens = state.get("window_tokens", 0) if isinstance(state, dict) else None
    if not isinstance(rng, dict) or not isinstance(grads, dict):
        raise _refuse(path, "rank state")
    for name, grad in grads.items():
        if name not in shapes or not isinstance(grad, torch.Tensor):
            raise _refuse(path, "rank state (gradients of this model's parameters)")
        if tuple(grad.shape) != shapes[name]:
            raise UserError(
                f"{path} holds a gradient of shape {tuple(grad.shape)} for {name}, which is "
                f"{shapes[name]} here; resume with the mesh it was saved with"
            )
    if isinstance(tokens, torch.Tensor) and tokens.numel() == 1 and not tokens.is_floating_point():
        tokens = int(tokens)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise _refuse(path, "rank state (a token count)")
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy(), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _restore_rng(path: Path, state: dict[str, Any]) -> None:
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        set_rng_state(state)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        raise _refuse(path, f"rank state (its RNG states: {type(exc).__name__})") from None


def _schedule_problem(state: dict[str, Any], schedule: Any) -> str | None:
    """A schedule's ``load_state_dict`` copies every key onto the object: none may replace one
    of its other attributes (its optimizer, a method), and each of its state's keys keeps the
    kind it has now (a number for a number, a list for a list). Keys it does not have (state of
    another torch version) are set as they are."""
    kinds = ((bool,), (int, float), (list, tuple), (dict,), (str,))
    current = schedule.state_dict()
    for key, value in state.items():
        if key not in current:
            if hasattr(schedule, key):
                return f"{key!r} would replace the schedule's own {key}"
            continue
        now = current[key]
        kind = next((k for k in kinds if isinstance(now, k)), None)
        if kind is not None and (
            not isinstance(value, kind) or (bool not in kind and isinstance(value, bool))
        ):
            return f"{key!r} is a {type(value).__name__}, not a {type(now).__name__}"
    return None


def load_state_into(target: Any, path: Path, state: Any, what: str) -> None:
    """``target.load_state_dict(state)`` (an optimizer or LR schedule); state that does not fit
    this run is one ``UserError`` naming the file."""
    if not isinstance(state, dict):
        raise _refuse(path, what)
    problem = _schedule_problem(state, target) if what == "LR schedule" else None
    try:
        if problem:
            raise ValueError(problem)
        target.load_state_dict(state)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
        reason = " ".join(str(exc).split())[:120] or type(exc).__name__
        raise UserError(
            f"{path} does not fit this run's {what} ({reason}); resume with the same optimizer and "
            "schedule settings, or pass --resume-only-model"
        ) from None


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


def load_state_parts(folder: Path, group: Any, *, verify: bool = True) -> list[str]:
    """Load the training state parts of ``layout.STATE_PARTS`` (optimizer, LR schedule) from
    ``folder`` into ``group``: each part the group has (not None) and the folder holds a file of.
    The files are verified against the completion marker (``verify=False``: the caller already
    did), then all read as data, before any part is loaded; a state that does not fit this run is
    one ``UserError`` naming its file. The state does not depend on the weights, so callers load
    it first: a refused part fails before the weights are replaced. Returns the parts loaded."""
    if verify:
        integrity.verify(folder, [name for name, _ in layout.STATE_PARTS.values()])
    states = {
        attr: read_state(folder / name)  # onto the CPU: the optimizer moves it to its parameters
        for attr, (name, _) in layout.STATE_PARTS.items()
        if getattr(group, attr) is not None and (folder / name).is_file()
    }
    for attr, state in states.items():
        name, what = layout.STATE_PARTS[attr]
        load_state_into(getattr(group, attr), folder / name, state, what)
    return list(states)


def load_checkpoint(
    folder: Path,
    *,
    model: Any,
    adapter_name: str,
    group: Any,
    rank: int,
    only_model: bool,
    load_weights: Any = None,
) -> dict:
    """Load weights (and, unless ``only_model``, optimizer, schedule, RNG). Returns this rank's
    open-window state for the caller to place: ``grads`` (name -> local gradient) and, in
    checkpoints that have it, ``window_tokens``; ``{}`` when ``only_model``.

    The files it reads are verified first (``read_trainer_state``, which a resume calls before,
    checks the whole folder), then read as data and their structure checked, all of them before
    the model is touched: a damaged or refused optimizer state fails the resume before the
    weights are replaced."""
    rank_file = folder / layout.rank_state_file(rank)
    reads = [layout.ADAPTER_WEIGHTS]
    if not only_model:
        reads += [rank_file.name, *(name for name, _ in layout.STATE_PARTS.values())]
    integrity.verify(folder, reads)
    if only_model:
        load_weights(folder)
        return {}
    if not rank_file.is_file():
        raise UserError(
            f"checkpoint {folder} has no state for rank {rank}; resume with the world size it was saved with"
        )
    shapes = {
        n: tuple((p.to_local() if hasattr(p, "to_local") else p).shape) for n, p in model.named_parameters()
    }
    rank_state = read_rank_state(rank_file, shapes)
    load_state_parts(folder, group, verify=False)  # before the weights: a misfit fails the resume first
    load_weights(folder)
    _restore_rng(rank_file, rank_state["rng"])
    return {k: v for k, v in rank_state.items() if k != "rng"}
