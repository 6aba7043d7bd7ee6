"""Padding-free batches: the rows of a right-padded batch laid end to end in one row.

Position ids restart at 0 for each sample; with no attention mask, Hugging Face's masking
builds a block-diagonal causal mask from them, so every sample attends only to itself and the
result equals the padded batch. No FLOPs go to padding in the linear layers, but attention
over the packed row covers all pairs (``T^2`` instead of ``sum(L_max^2)``), so packing pays
only when padding costs more than that: ``choose_packing`` decides per batch."""

from typing import Any

import torch

from twinkle.template.base import IGNORE_INDEX

# Decoder families whose masking honours packed position ids (create_causal_mask).
PACKABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def pack(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``(B, L)`` right-padded -> ``(1, T)`` with ``T`` the number of real tokens."""
    keep = batch["attention_mask"].bool()
    labels = batch["labels"].clone()
    labels[:, 0] = IGNORE_INDEX  # never a target in the padded layout either (it has no predecessor)
    return {
        "input_ids": batch["input_ids"][keep][None],
        "labels": labels[keep][None],
        "position_ids": batch["position_ids"][keep][None],
        "attention_mask": None,
    }


def _costs(config: Any) -> tuple[float, float]:
    """FLOPs per token in one layer's linear maps, and per (query, key) pair in its attention."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    inter = getattr(config, "intermediate_size", 4 * hidden)
    linear = 2 * (hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2 + 3 * hidden * inter)
    return float(linear), float(4 * heads * head_dim)


def choose_packing(config: Any, lengths: torch.Tensor) -> bool:
    """Pack when the padded batch would cost more than the packed row (forward FLOPs model)."""
    if getattr(config, "model_type", None) not in PACKABLE_MODEL_TYPES or lengths.numel() < 2:
        return False
    linear, pair = _costs(config)
    b, width, total = lengths.numel(), int(lengths.max()), int(lengths.sum())
    padded = b * width * linear + b * width * width * pair
    packed = total * linear + total * total * pair
    return packed < padded
