"""Tinker's datums as twinkle batches, and the LoRA every tenant's adapter gets.

Tinker ``Datum`` to twinkle batch: input tokens ``x[0..n)`` with ``target_tokens`` ``y`` (``y[i]``
is predicted at position ``i``) become the row ``x + [y[n-1]]`` with labels ``[-100] + y``
(twinkle's labels are aligned with the inputs and shifted by the model)."""

from typing import Any

import numpy as np
import torch

from twinkle.server.wire import Datum

IGNORE = -100
LOSS_INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
}
LORA_ALPHA = 32  # Tinker's LoRA alpha


def lora_config(rank: int, lm: Any = None) -> Any:
    """Tinker's LoRA on every linear layer; on a model with a vision tower, those of its language
    model (the vision tower and projector frozen, as ``TransformersModel`` places LoRA by default,
    ``twinkle.model.vision``)."""
    from peft import LoraConfig

    config = LoraConfig(r=rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear")
    if lm is None or getattr(lm.config, "vision_config", None) is None:
        return config
    from twinkle.model.vision import VISION_MODULES

    # the decoder's linear layers by name (a layer already wrapped by LoRA holds it as base_layer)
    names = {
        k.removesuffix(".base_layer").rsplit(".", 1)[-1]
        for k, m in lm.get_decoder().named_modules()
        if isinstance(m, torch.nn.Linear) and "lora_" not in k
    }
    config.target_modules, config.exclude_modules = sorted(names), VISION_MODULES
    return config


def datum_batch(data: list[Datum], loss_fn: str, pad_id: int) -> tuple[dict, dict]:
    """(batch of tensors, the loss's extra inputs) of Tinker datums: row ``x + [y[-1]]``,
    labels ``[-100] + y``, each per-token input aligned with the labels. No datums: a batch of
    no rows (the model runs one unlabelled pad token for it)."""
    width = max((d.tokens.size for d in data), default=0) + 1
    shape = (len(data), width)
    batch = {
        "input_ids": torch.full(shape, pad_id, dtype=torch.long),
        "labels": torch.full(shape, IGNORE, dtype=torch.long),
        "attention_mask": torch.zeros(shape, dtype=torch.long),
        "position_ids": torch.zeros(shape, dtype=torch.long),
    }
    sources = {"tinker_weights": "weights"} if loss_fn == "cross_entropy" else {}
    sources = sources or {"old_logps": "logprobs", "advantages": "advantages"}
    extras = {k: torch.zeros(shape, dtype=torch.float32) for k in sources}
    for b, d in enumerate(data):
        n = d.tokens.size + 1
        targets = torch.from_numpy(d.inputs["target_tokens"].astype(np.int64))
        batch["input_ids"][b, :n] = torch.cat([torch.tensor(d.tokens, dtype=torch.long), targets[-1:]])
        batch["labels"][b, 1:n] = targets
        batch["attention_mask"][b, :n] = 1
        batch["position_ids"][b, :n] = torch.arange(n)
        for name, src in sources.items():
            extras[name][b, 1:n] = torch.from_numpy(d.inputs[src].astype(np.float32))
    batch.update(vision_batch(data))
    return batch, extras


def vision_batch(data: list[Datum]) -> dict[str, torch.Tensor]:
    """The datums' placed images (``twinkle.server.images``) as one batch's ``pixel_values``
    and ``image_grid_thw`` (Gemma: ``pixel_values`` one entry per image, and Gemma 4's
    ``image_position_ids``), in row order (the model matches them to the placeholder tokens in
    that order), and ``image_counts``, each row's number of images (as
    ``twinkle.processor.collate`` gives them: packing and micro-batches find a row's images by
    it); empty when no datum has one."""
    placed = [d.vision for d in data if d.vision is not None]
    if not placed:
        return {}
    out = {k: torch.from_numpy(np.concatenate([v[k] for v in placed])) for k in placed[0]}

    def images(vision: dict[str, np.ndarray]) -> int:
        return len(vision["image_grid_thw"] if "image_grid_thw" in vision else vision["pixel_values"])

    counts = [0 if d.vision is None else images(d.vision) for d in data]
    out["image_counts"] = torch.tensor(counts, dtype=torch.long)
    return out
