"""Pad a list of encoded samples into one batch of tensors."""

from collections.abc import Sequence
from typing import Any

import torch

from twinkle.template.base import IGNORE_INDEX


def collate(samples: Sequence[dict[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: pad tokens get ``attention_mask`` 0 and label -100.

    An empty list (a rank whose share of a short last batch is nothing) gives tensors of shape
    ``(0, 0)``; the model still joins the collectives for it."""
    width = max((len(s["input_ids"]) for s in samples), default=0)
    n = len(samples)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    position_ids = torch.zeros((n, width), dtype=torch.long)
    for i, s in enumerate(samples):
        k = len(s["input_ids"])
        input_ids[i, :k] = torch.tensor(s["input_ids"])
        labels[i, :k] = torch.tensor(s["labels"])
        attention_mask[i, :k] = 1
        position_ids[i, :k] = torch.arange(k)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }
