"""Write a checkpoint from every rank into a temporary folder, then rename it into place.

Everything is written as data that loads with ``torch.load(weights_only=True)``, safetensors or
JSON: the RNG states as tuples of ints and tensors (numpy's key array as a tensor), the optimizer
and schedule state as their ``state_dict`` of tensors and plain values (checked before the
save: ``data_only``). A folder of the target name that Twinkle did not write is never replaced
(``check_not_foreign``)."""

import io
import json
import random
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save as safetensors_bytes

from twinkle.checkpoint import integrity, layout
from twinkle.distributed.collectives import all_reduce_sum
from twinkle.utils.errors import UserError
from twinkle.utils.fileio import fsync_tree, is_complete, swap_into_place

# Types that load under ``weights_only=True`` without any allow-listing (a subset of them);
# compared exactly, so a subclass (an enum, a named tuple, a defaultdict) is confirmed by a load.
_PLAIN = {int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Tensor}
_SEQUENCES = {list, tuple, torch.Size}
_MAPPINGS = {dict, OrderedDict}


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.copy()),
            "pos": pos,
            "has_gauss": has_gauss,
            "gauss": gauss,
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def full_adapter_state(model: Any, adapter_name: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors, gathered to full size (a collective under FSDP: all ranks call it)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    out = {}
    for key, value in state.items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[key] = value.detach().to("cpu").contiguous()
    return out


def _write_bytes(path: Path, data: bytes | memoryview) -> None:
    with open(path, "wb") as handle:
        handle.write(data)


def _torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` through memory: written to a file directly, a full disk surfaces as an opaque
    ``RuntimeError`` from its zip writer; Python's own write raises ``OSError(ENOSPC)``."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    _write_bytes(path, buffer.getbuffer())


def save_checkpoint(
    final: Path,
    *,
    model: Any,
    tokenizer: Any,
    adapter_name: str,
    group: Any,
    trainer_state: dict[str, Any],
    save_optimizer: bool,
    rank: int,
    grads: dict[str, torch.Tensor],
    export: tuple[dict[str, torch.Tensor], Any] | None = None,
) -> Path:
    """Every rank calls this. Rank 0 owns the folder; each rank writes its own files.
    ``export``: the adapter's (tensors, LoRA config) to write, already gathered on every rank;
    None takes PEFT's state of ``adapter_name``.

    The ranks agree after each phase (an all-reduce of failures, in place of a barrier), so a
    write that fails on one rank fails the save on all of them at once instead of leaving the
    others waiting for the process-group timeout. When the agreement itself fails (another rank's
    process died), rank 0 removes the temporary folder before the error ends the job."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp")
    phases = (
        lambda: _prepare(tmp, final) if rank == 0 else None,
        lambda: _write_files(
            tmp, model, tokenizer, adapter_name, group, trainer_state, save_optimizer, rank, grads, export
        ),
        lambda: _finish(tmp, final) if rank == 0 else None,
    )
    for phase in phases:
        error = _run_phase(phase)
        try:
            (failures,) = all_reduce_sum([error is not None])
        except Exception:  # a rank is gone (killed mid-save): the job ends, leaving no half-written folder
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if failures:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # whatever failed, leave no half-written folder
            if error is None:
                raise UserError(f"could not write checkpoint {final}: another rank failed (see its error)")
            if isinstance(error, OSError):
                raise UserError(
                    f"could not write checkpoint {final} ({error.strerror or error}); nothing was replaced, an "
                    "earlier checkpoint of that name is intact; free disk space or choose a writable --output-dir"
                ) from error
            raise error
    return final


def _run_phase(phase) -> BaseException | None:  # noqa: ANN001
    try:
        phase()
    except Exception as exc:  # reported to every rank, then re-raised by this one
        return exc
    return None


def check_not_foreign(final: Path) -> None:
    """``UserError`` when ``final`` exists without the completion marker: a Twinkle save leaves
    only its hidden ``.<name>.tmp`` when interrupted, so such a folder is someone else's and is
    never replaced. A link there is left to ``swap_into_place`` (it replaces the link only)."""
    if final.exists() and not final.is_symlink() and not is_complete(final):
        raise UserError(layout.foreign_message(final))


def _not_data(obj: Any, where: str, depth: int = 0) -> str | None:
    """Where ``obj`` holds something other than tensors and plain values; None if nowhere."""
    if type(obj) in _PLAIN or depth > 50:
        return None
    if type(obj) in _SEQUENCES:
        found = (_not_data(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj))
        return next((f for f in found if f), None)
    if type(obj) in _MAPPINGS:
        found = (
            _not_data(k, f"{where} key", depth + 1) or _not_data(v, f"{where}[{k!r}]", depth + 1)
            for k, v in obj.items()
        )
        return next((f for f in found if f), None)
    return f"{where} ({type(obj).__module__}.{type(obj).__qualname__})"


def data_only(obj: Any, what: str, name: str) -> None:
    """``UserError`` before the save when the state ``obj`` would need code to load: a checkpoint
    holds tensors and plain values only, so that loading one runs nothing. What the quick walk
    flags (a tensor subclass, a container type) is confirmed by loading it back as data."""
    where = _not_data(obj, "state")
    if where is None:
        return
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:  # not picklable at all, or not as data
        raise UserError(
            f"cannot save {name}: the {what} state holds {where}, which does not load as data (a "
            f"checkpoint holds tensors and plain values only); use {what}s whose state_dict holds only those"
        ) from None


def state_parts(group: Any, save_optimizer: bool) -> list[tuple[str, Any]]:
    """(file, state dict) of each part of ``layout.STATE_PARTS`` the group has (not None), each
    checked as data (``data_only``) before anything is written; the optimizer only with
    ``save_optimizer``. ``load.load_state_parts`` reads them back."""
    parts = []
    for attr, (name, what) in layout.STATE_PARTS.items():
        part = getattr(group, attr)
        if part is None or (attr == "optimizer" and not save_optimizer):
            continue
        state = part.state_dict()
        data_only(state, what, name)
        parts.append((name, state))
    return parts


def _prepare(tmp: Path, final: Path) -> None:
    check_not_foreign(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def _write_files(
    tmp, model, tokenizer, adapter_name, group, trainer_state, save_optimizer, rank, grads, export
) -> None:  # noqa: ANN001
    if export is None:  # a collective: every rank, before any early exit
        export = (full_adapter_state(model, adapter_name), model.peft_config[adapter_name])
    adapter, config = export
    # The open window's token count differs per rank (trainer_state.json holds rank 0's only).
    rank_state = {"rng": rng_state(), "grads": grads, "window_tokens": group.window_tokens}
    # Every file is written by Python's own ``write``, so a full disk is an ``OSError`` whatever
    # the serialiser (safetensors and torch.save report it as their own exception types).
    _torch_save(rank_state, tmp / layout.rank_state_file(rank))
    if rank == 0:
        for name, part in state_parts(group, save_optimizer):
            _torch_save(part, tmp / name)
        _write_bytes(tmp / layout.ADAPTER_WEIGHTS, safetensors_bytes(adapter, metadata={"format": "pt"}))
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        state = {**trainer_state, "format_version": layout.FORMAT_VERSION, "saved_optimizer": save_optimizer}
        (tmp / layout.TRAINER_STATE).write_text(json.dumps(state, indent=2))


def _finish(tmp: Path, final: Path) -> None:
    # Every rank's files are written (the phases agree first): the marker lists them all.
    (tmp / layout.MARKER).write_text(integrity.marker_text(tmp))
    fsync_tree(tmp)
    swap_into_place(tmp, final)
