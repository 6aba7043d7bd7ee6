"""Extra batch inputs a loss declares (``Loss.extra_inputs``), passed to the model's steps as
keywords: ``forward_backward(inputs, ref_outputs=ref)`` gives ``ref_logps`` (the ``logps`` of
what ``forward_only`` returned), ``forward_backward(inputs, old_logps=..., advantages=...)`` any
other. Each value is per label, ``(B, L)`` aligned with ``labels``, or per row, ``(B,)``; it
joins the batch under its name, where the model hands it to the loss (``twinkle.model.forward``).
A value may also come inside the batch itself (a ``DataLoader`` column)."""

from collections.abc import Mapping
from typing import Any

import torch

from twinkle.distributed.collectives import all_reduce_max
from twinkle.loss.base import align_completion_values
from twinkle.loss.preference import PreferenceLoss
from twinkle.model.transformers.moe.router_replay import RouterReplayAction
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

REF_HINT = "ref_outputs=model.forward_only(inputs=batch, disable_lora=True)"


def _from_ref_outputs(ref_outputs: Any) -> torch.Tensor:
    logps = ref_outputs.get("logps") if isinstance(ref_outputs, Mapping) else None
    if logps is None:
        raise UserError(
            f"ref_outputs= got {type(ref_outputs).__name__} without 'logps'; pass what model.forward_only(...) returned"
        )
    return logps


# upstream's step keywords that are not loss inputs: the value that changes nothing is accepted,
# any other is refused by name (name -> (accepted value, why another is refused))
STEP_KEYWORDS: dict[str, tuple[Any, str]] = {
    "temperature": (1.0, "the step's log-probabilities are the model's own (temperature 1)"),
    "return_logits": (False, "the step never builds full logits; read outputs['logps']"),
}
_said_replay_off: list[bool] = []  # the router_replay_action warning, once per process


def refuse_step_keywords(given: dict[str, Any]) -> None:
    """Pop upstream's step keywords from ``given``: accepted at their neutral value, else one line.
    ``router_replay_action`` acts on a model built with ``enable_router_replay=True``, which takes
    it before this (``twinkle.model.router_replay``); here it reaches a model built without
    replay, where it has nothing to act on, as on upstream's: accepted with one warning, as is
    ``router_replay_manual_cleanup``."""
    given.pop("router_replay_manual_cleanup", None)
    action = given.pop("router_replay_action", None)
    if action is not None:
        if not isinstance(action, RouterReplayAction):
            raise UserError(f"router_replay_action={action!r}: expected a RouterReplayAction or None")
        if not _said_replay_off:
            _said_replay_off.append(True)
            get_logger().warning(
                "router_replay_action=%s: nothing to replay, the model was built without "
                "enable_router_replay; ignored, as upstream does",
                action.name,
            )
    for name, (neutral, why) in STEP_KEYWORDS.items():
        if name in given:
            value = given.pop(name)
            if value != neutral:
                raise UserError(f"{name}={value!r} is not supported yet: {why}")


def keyword_inputs(loss: Any, ref_outputs: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords as batch inputs, each one the loss declares (else a one-line error);
    upstream's step keywords (``STEP_KEYWORDS``) are checked and dropped first."""
    given = dict(given)
    refuse_step_keywords(given)
    if ref_outputs is not None:
        if "ref_logps" in given:
            raise UserError("pass ref_outputs= or ref_logps=, not both")
        given["ref_logps"] = _from_ref_outputs(ref_outputs)
    # ``step_keywords``: keywords a loss turns into its inputs itself (``batch_inputs``)
    declared = tuple(getattr(loss, "extra_inputs", ())) + tuple(getattr(loss, "step_keywords", ()))
    for name in given:
        if name not in declared:
            via = (
                "ref_outputs= (its ref_logps)"
                if name == "ref_logps" and ref_outputs is not None
                else f"{name}="
            )
            reads = ", ".join(declared) or "nothing besides the batch"
            raise UserError(
                f"{via} is not an input of the loss {loss.name} (it reads {reads}); "
                "set the loss that reads it with model.set_loss(...), or drop the keyword"
            )
    return given


def missing_inputs(loss: Any, batch: Mapping[str, Any]) -> list[str]:
    """The loss's declared inputs the batch lacks (none for a batch without a supervised label:
    a rank's empty share)."""
    missing = [k for k in getattr(loss, "extra_inputs", ()) if not torch.is_tensor(batch.get(k))]
    return missing if missing and bool((batch["labels"] != IGNORE_INDEX).any()) else []


def with_loss_inputs(loss: Any, batch: Mapping[str, Any], extras: Mapping[str, Any], required: bool) -> dict:
    """``batch`` with ``extras`` added as tensors, each checked against the batch's shape.
    ``required``: a declared input neither in the batch nor in ``extras`` is a one-line error."""
    labels = batch["labels"]
    rows, length = int(labels.shape[0]), int(labels.shape[1])
    if rows == 0:  # this rank's empty share of a short last batch runs one unlabelled pad
        return dict(batch)
    out = dict(batch)
    fit = getattr(loss, "batch_inputs", None)  # a loss's own inputs of another shape (GKD's (B, L, k))
    wide = ()
    if fit is not None:
        extras = fit(extras, labels)
        wide = tuple(getattr(loss, "extra_inputs", ()))
    for name, value in extras.items():
        value = align_completion_values(name, value, labels)  # one ragged list per row: its completion
        tensor = value if torch.is_tensor(value) else torch.as_tensor(value, dtype=torch.float32)
        if name in wide and tensor.dim() == 3 and tuple(tensor.shape[:2]) == (rows, length):
            out[name] = tensor  # per label, several values each
            continue
        if tuple(tensor.shape) not in ((rows, length), (rows,)):
            raise UserError(
                f"{name} has shape {tuple(tensor.shape)}, but the batch is {rows} x {length}; pass one value "
                f"per label ({rows}, {length}) or per row ({rows},), computed on this same batch"
            )
        out[name] = tensor
    missing = missing_inputs(loss, out)
    if required and missing:
        hints = [REF_HINT if k == "ref_logps" else f"{k}=..." for k in missing]
        raise UserError(
            f"the loss {loss.name} needs the batch tensor(s) {missing}; add them to every batch or pass "
            f"them to the step: {', '.join(hints)}"
        )
    return out


def split_rows(batch: Mapping[str, Any], micro_batch_size: int, loss: Any) -> list[dict]:
    """``batch`` (this rank's rows, the loss's inputs included) in parts of ``micro_batch_size``
    rows, as many parts on every rank (a rank with fewer rows runs empty parts, which join the
    collectives as a pad row). A preference loss keeps each (chosen, rejected) pair in one part."""
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise UserError(f"micro_batch_size must be a whole number of rows >= 1, got {micro_batch_size!r}")
    if isinstance(loss, PreferenceLoss) and micro_batch_size % 2:
        raise UserError(
            f"micro_batch_size={micro_batch_size} would split a (chosen, rejected) pair of {loss.name}; "
            "give an even number of rows"
        )
    rows = int(batch["input_ids"].shape[0])
    parts = int(all_reduce_max([-(-rows // micro_batch_size)])[0])
    images = {k: batch[k] for k in IMAGE_KEYS if k in batch}
    out = [
        {
            k: v[i * micro_batch_size : (i + 1) * micro_batch_size]
            if torch.is_tensor(v) and v.dim() and v.shape[0] == rows
            else v
            for k, v in batch.items()
            if k not in images
        }
        for i in range(max(1, parts))
    ]
    if images:
        for i, part in enumerate(out):
            part.update(_images_of_rows(images, i * micro_batch_size, (i + 1) * micro_batch_size))
    return out


IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_position_ids", "image_counts")


def _images_of_rows(images: Mapping[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    """The images of rows ``start:stop`` (``twinkle.processor.collate``): their grids by the rows'
    image counts, their patches by the grids' sizes (t * h * w patches an image); without grids
    (Gemma) one ``pixel_values`` entry (and ``image_position_ids`` entry) an image. A part without
    images holds none of the keys, as a text-only batch."""
    counts = images["image_counts"]
    first, last = int(counts[:start].sum()), int(counts[:stop].sum())
    if first == last:
        return {}
    if "image_grid_thw" not in images:
        out = {k: images[k][first:last] for k in ("pixel_values", "image_position_ids") if k in images}
        return {**out, "image_counts": counts[start:stop]}
    sizes = images["image_grid_thw"].prod(dim=1)
    return {
        "pixel_values": images["pixel_values"][int(sizes[:first].sum()) : int(sizes[:last].sum())],
        "image_grid_thw": images["image_grid_thw"][first:last],
        "image_counts": counts[start:stop],
    }
