"""Prompts with images on the Gemma vision-language families (Gemma 3, Gemma 4), as the sampler's
prefill takes them (``twinkle.sampler.vision_prefill``).

A Gemma prompt's images carry no grid sizes: each image is one entry of ``pixel_values`` (Gemma 3
a square image; Gemma 4 its patches padded to the processor's budget, with ``image_position_ids``
marking the padding with -1), and its soft tokens are one run of the image token between
``boi_token`` and ``eoi_token``. Positions are plain (one axis, counting real tokens), as for text.

What differs from a text prefill is the attention among an image's tokens: they see each other
both ways (Gemma 3 always, Gemma 4 where ``use_bidirectional_attention='vision'``), and the model
builds that mask from the token types it is given (``token_type_ids`` on Gemma 3,
``mm_token_type_ids`` on Gemma 4; ``twinkle.model.vision_inputs``). Transformers reads them by
absolute index over the cache and the new tokens, so a forward that runs after a cached prefix is
given the token types of the whole row, prefix included, as ``generate`` gives them to its first
forward. Decoding steps get none: a drawn token is text and attends causally."""

from typing import Any

import torch

from twinkle.model.vision_inputs import GEMMA_IMAGE_INPUTS

Vision = dict[str, torch.Tensor]
IMAGE_KEYS = ("pixel_values", "image_position_ids")  # Gemma 4's positions; Gemma 3 has none


def is_gemma(lm: Any) -> bool:
    """Whether ``lm`` is a Gemma vision-language model (its images carry no grid sizes)."""
    return getattr(getattr(lm, "config", None), "model_type", None) in GEMMA_IMAGE_INPUTS


def gemma_vision_of(row: Any) -> Vision:
    """A Gemma prompt row's images as tensors: ``pixel_values`` (one entry per image) and, on
    Gemma 4, ``image_position_ids``."""
    vision = {"pixel_values": torch.as_tensor(row["pixel_values"])}
    if row.get("image_position_ids") is not None:
        vision["image_position_ids"] = torch.as_tensor(row["image_position_ids"], dtype=torch.long)
    return vision


def gemma_counts(lm: Any, vision: Vision) -> list[int]:
    """How many soft tokens each image takes: Gemma 3 a fixed ``mm_tokens_per_image``; Gemma 4
    its real (unpadded) patches pooled ``pooling_kernel_size`` squared at a time."""
    images = int(vision["pixel_values"].shape[0])
    positions = vision.get("image_position_ids")
    if positions is None:
        return [int(lm.config.mm_tokens_per_image)] * images
    pool = int(lm.config.vision_config.pooling_kernel_size) ** 2
    real = (positions != -1).all(dim=-1).sum(dim=-1)
    return [int(n) // pool for n in real]


def gemma_images(vision: Vision) -> list[Vision]:
    """Each image's own entries (a batch of one), in prompt order."""
    count = int(vision["pixel_values"].shape[0])
    return [{k: v[j : j + 1] for k, v in vision.items() if k in IMAGE_KEYS} for j in range(count)]


def image_token_types(lm: Any, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The forward's token types for ``ids`` (1 at the image tokens) under the family's name."""
    _, name = GEMMA_IMAGE_INPUTS[lm.config.model_type]
    return {name: (ids == lm.config.image_token_id).to(torch.long)}
