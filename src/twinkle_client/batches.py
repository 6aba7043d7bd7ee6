"""The local API's inputs as Tinker datums: encoded rows (or a padded batch of tensors) become
shifted datums (``twinkle.server.common.shifted``), and the step's values a loss reads
(reference log-probs, the sampler's log-probs, advantages) become one value per datum token.

A step value arrives in any shape the local ``forward_backward`` takes: one number per row
``(B,)``, one per label ``(B, L)`` (``forward_only``'s ``logps``), or one list per row of the
completion's values only (the sampler's log-probs). ``per_label`` turns each into ``(B, L)``
aligned with the labels; the datum of row ``b`` then carries ``values[b, 1:n]``."""

from typing import Any

import numpy as np
import torch

from twinkle.server.common import IGNORE, images_of, shifted

IMAGES = ("pixel_values", "image_grid_thw", "image_position_ids")  # any VL family's row's


def _as_list(values: Any) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def rows_of(inputs: Any) -> list[dict[str, list[int]]]:
    """``[{"input_ids", "labels"}]`` of encoded rows, one row, or a padded batch of tensors
    (``attention_mask`` marks each row's length)."""
    if (
        isinstance(inputs, dict)
        and hasattr(inputs.get("input_ids"), "shape")
        and inputs["input_ids"].ndim == 2
    ):
        mask = inputs.get("attention_mask")
        out = []
        for b in range(len(inputs["input_ids"])):
            n = int(mask[b].sum()) if mask is not None else len(inputs["input_ids"][b])
            labels = inputs.get("labels", inputs["input_ids"])
            out.append({"input_ids": _as_list(inputs["input_ids"][b])[:n], "labels": _as_list(labels[b])[:n]})
        return out
    rows = [inputs] if isinstance(inputs, dict) else list(inputs)
    out = []
    for i, row in enumerate(rows):
        if "input_ids" not in row:
            raise ValueError(f"row {i} has no input_ids; encode it first (set_template, or Template.encode)")
        ids = _as_list(row["input_ids"])
        labels = row.get("labels")
        images = {k: row[k] for k in IMAGES if row.get(k) is not None}  # a VL template's row
        out.append({"input_ids": ids, "labels": ids if labels is None else _as_list(labels), **images})
    return out


def labels_of(rows: list[dict[str, list[int]]]) -> torch.Tensor:
    """The rows' labels as one ``(B, L)`` tensor, -100 past each row's end."""
    width = max(len(r["labels"]) for r in rows)
    out = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, : len(r["labels"])] = torch.tensor(r["labels"], dtype=torch.long)
    return out


def per_label(name: str, value: Any, labels: torch.Tensor) -> torch.Tensor:
    """``value`` as ``(B, L)`` aligned with ``labels`` (see the module's docstring)."""
    from twinkle.loss.base import align_completion_values

    if isinstance(value, dict) and "logps" in value:  # forward_only's outputs (ref_outputs)
        value = value["logps"]
    if hasattr(value, "result") and not torch.is_tensor(value):
        value = value.result["logps"] if isinstance(value.result, dict) else value.result
    rows, length = labels.shape
    aligned = align_completion_values(name, value, labels)
    tensor = torch.as_tensor(aligned, dtype=torch.float32)
    if tensor.ndim == 1 and tensor.numel() == rows:
        return tensor[:, None].expand(rows, length).clone()
    if tensor.ndim == 2 and tensor.shape[0] == rows and tensor.shape[1] >= length:
        return tensor[:, :length]
    raise ValueError(
        f"{name}: shape {tuple(tensor.shape)} is neither ({rows},) per row nor ({rows}, {length}) per label"
    )


def datums_of(rows: list[dict[str, list[int]]], values: dict[str, torch.Tensor] | None = None) -> list[Any]:
    """Tinker datums of the rows; ``values``: wire name -> ``(B, L)`` per-label values."""
    from tinker import types

    data = []
    for b, row in enumerate(rows):
        model_input, targets, weights = shifted(row["input_ids"], row["labels"])
        inputs = {
            "target_tokens": types.TensorData.from_numpy(np.asarray(targets, dtype=np.int64)),
            "weights": types.TensorData.from_numpy(np.asarray(weights, dtype=np.float32)),
        }
        for name, tensor in (values or {}).items():
            part = tensor[b, 1 : len(row["input_ids"])].numpy().astype(np.float32)
            inputs[name] = types.TensorData.from_numpy(np.ascontiguousarray(part))
        # a Gemma row's input with its images as ImageChunks (image_prompts.training_input)
        chunked = row.get("chunked")
        if chunked is None:
            inputs.update(images_of(row))  # its processed images, as input_feature_to_datum sends them
            chunked = types.ModelInput.from_ints(model_input)
        data.append(types.Datum(model_input=chunked, loss_fn_inputs=inputs))
    return data


def logps_per_label(rows: list[dict[str, list[int]]], per_datum: list[Any]) -> torch.Tensor:
    """The server's per-datum target log-probs as ``(B, L)`` aligned with the labels, 0 where a
    label is -100 (the local ``forward_only``'s ``logps``)."""
    labels = labels_of(rows)
    out = torch.zeros(labels.shape, dtype=torch.float32)
    for b, lp in enumerate(per_datum):
        values = torch.as_tensor(np.asarray(lp, dtype=np.float32))
        out[b, 1 : 1 + values.numel()] = values
    return out.masked_fill(labels == IGNORE, 0.0)
