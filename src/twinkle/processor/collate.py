"""Pad a list of encoded samples into one batch of tensors (``InputProcessor``'s work).

A row of a ``PackingDataset`` holds several samples end to end, its ``position_ids`` starting
again at 0 at each one. ``collate`` gives each of those samples its own row of the batch: the
model keeps the rows of a batch apart (and, padding-free, lays them end to end again with
attention per sample, see ``twinkle.model.packing``), whereas one row with restarting positions
would let every sample attend to the samples before it."""

from collections.abc import Sequence
from typing import Any

import torch

from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError


def segment_starts(position_ids: Sequence[int]) -> list[int]:
    """Where each sample of a row begins: 0 and every later position whose id is 0."""
    ids = position_ids.tolist() if hasattr(position_ids, "tolist") else list(position_ids)
    try:
        ids.index(0, 1)
    except ValueError:  # the common case, one sample: found at C speed
        return [0]
    return [0] + [i for i in range(1, len(ids)) if ids[i] == 0]


def split_packed(sample: dict[str, Any]) -> list[dict[str, Any]]:
    """A packed row -> its samples (``input_ids`` and ``labels`` each); a plain sample as is."""
    positions = sample.get("position_ids")
    starts = segment_starts(positions) if positions is not None else [0]
    if len(starts) == 1:
        return [sample]
    if "pixel_values" in sample:
        raise UserError(
            "a packed row (PackingDataset) holds images (pixel_values): its samples' images cannot be "
            "told apart; leave image rows unpacked (Dataset or LazyDataset)"
        )
    bounds = [*starts, len(sample["input_ids"])]
    return [
        {"input_ids": sample["input_ids"][a:b], "labels": sample["labels"][a:b]}
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]


def is_pair(row: Any) -> bool:
    """An encoded preference row: ``{'positive': sample, 'negative': sample, ...}``."""
    return (
        isinstance(row, dict)
        and isinstance(row.get("positive"), dict)
        and isinstance(row.get("negative"), dict)
    )


def interleave_pairs(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Preference rows -> their samples as ``[pos_1, neg_1, pos_2, neg_2, ...]`` (upstream's
    ``prepare_dpo_batch``): each side gets the row's other fields too. Other rows pass as they are."""
    out: list[dict[str, Any]] = []
    for row in rows:
        if not is_pair(row):
            out.append(row)
            continue
        rest = {k: v for k, v in row.items() if k not in ("positive", "negative", "length")}
        out += [{**rest, **row["positive"]}, {**rest, **row["negative"]}]
    return out


def collate(
    samples: Sequence[dict[str, Any]], pad_token_id: int, padding_side: str = "right"
) -> dict[str, torch.Tensor]:
    """Pad to the longest sample: pad tokens get ``attention_mask`` 0 and label -100; each
    sample's ``position_ids`` count from 0 at its first real token. ``padding_side='left'`` puts
    the pads before the tokens (the model then runs the batch padded, not packed).

    A packed row becomes one row per sample it holds (see the module docstring). A preference
    row becomes two rows, its positive then its negative side (``interleave_pairs``), so a batch
    of ``n`` pairs has ``2n`` rows, the pairs' sides next to each other. An empty list (a rank
    whose share of a short last batch is nothing) gives tensors of shape ``(0, 0)``; the model
    still joins the collectives for it."""
    samples = interleave_pairs(samples)
    if any("input_ids" not in s for s in samples):
        raise UserError(
            "the rows are not encoded (no 'input_ids'); call dataset.encode() first, "
            "or pass a collate function of your own for rows of your own"
        )
    samples = [part for s in samples for part in split_packed(s)]
    width = max((len(s["input_ids"]) for s in samples), default=0)
    n = len(samples)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    position_ids = torch.zeros((n, width), dtype=torch.long)
    left = padding_side == "left"
    for i, s in enumerate(samples):
        k = len(s["input_ids"])
        real = slice(width - k, width) if left else slice(0, k)
        input_ids[i, real] = torch.as_tensor(s["input_ids"])
        labels[i, real] = torch.as_tensor(s["labels"])
        attention_mask[i, real] = 1
        position_ids[i, real] = torch.arange(k)
    batch = {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }
    with_images = [s for s in samples if "pixel_values" in s]
    if with_images:  # every row's patches, in row order; one (t, h, w) per image
        for key in IMAGE_TENSORS:
            if key in with_images[0]:
                batch[key] = torch.cat([torch.as_tensor(s[key]) for s in with_images])
        # how many images each row holds: what splitting the batch into parts of rows needs
        batch["image_counts"] = torch.tensor([images_in(s) for s in samples], dtype=torch.long)
    return batch


# a row's image tensors: Qwen's patches and grids, or (Gemma) one entry per image and Gemma 4's
# patch positions
IMAGE_TENSORS = ("pixel_values", "image_grid_thw", "image_position_ids")


def images_in(sample: dict[str, Any]) -> int:
    """How many images a row holds: one grid each (Qwen), else one ``pixel_values`` entry each."""
    if "pixel_values" not in sample:
        return 0
    return len(sample["image_grid_thw"] if "image_grid_thw" in sample else sample["pixel_values"])
