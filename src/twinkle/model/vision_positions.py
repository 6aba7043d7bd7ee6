"""Positions of image rows on a Qwen vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5).

These models give each token three rotary positions (M-RoPE: time, height, width). A text token
has the same position on the three axes, counting on from the token before it; an image's tokens
share one time position and run over the image's rows and columns, and the text after the image
goes on from the largest position the image took. The model works these positions out itself from
``input_ids``, ``image_grid_thw`` and, in transformers 5, ``mm_token_type_ids`` (which tokens are
an image's): a forward given the first two but not the third falls back to plain positions
(``0, 1, 2, ...`` on every axis), unlike the rows the model's own processor makes. So a forward
over image rows passes the token types (``token_type_inputs``), and a sampler that runs a prompt
in parts asks the model for the whole prompt's positions once (``rope_positions``); its decoding
positions then go on from the prompt's largest position plus one, as ``generate`` continues them
(its ``rope_deltas``)."""

import inspect
from typing import Any

import torch

from twinkle.utils.errors import UserError


def _inner(lm: Any) -> Any:
    """The module that holds ``get_rope_index`` (the ``*Model`` under ``*ForConditionalGeneration``)."""
    for module in (lm, getattr(lm, "model", None)):
        if module is not None and callable(getattr(module, "get_rope_index", None)):
            return module
    return None


def reads_images(lm: Any) -> bool:
    """Whether ``lm`` has a vision tower (``config.vision_config``)."""
    return getattr(getattr(lm, "config", None), "vision_config", None) is not None


def _takes_token_types(function: Any) -> bool:
    return "mm_token_type_ids" in inspect.signature(function).parameters


def token_types(lm: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """``mm_token_type_ids``: 1 at an image's tokens, 2 at a video's, 0 elsewhere."""
    config = lm.config
    types = (input_ids == config.image_token_id).to(torch.int32)
    video = getattr(config, "video_token_id", None)
    if video is not None:
        types = types + 2 * (input_ids == video).to(torch.int32)
    return types


def token_type_inputs(lm: Any, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The forward's ``mm_token_type_ids`` for ``input_ids`` where its forward takes them (a
    model that reads the image tokens from ``input_ids`` alone gets nothing)."""
    if not reads_images(lm) or not _takes_token_types(type(lm).forward):
        return {}
    return {"mm_token_type_ids": token_types(lm, input_ids)}


def rope_positions(lm: Any, ids: list[int], image_grid_thw: torch.Tensor) -> torch.Tensor:
    """The ``(3, len(ids))`` M-RoPE positions of one prompt with images (the model's own
    ``get_rope_index``)."""
    inner = _inner(lm)
    if inner is None:
        raise UserError(
            f"sampling with images is supported on Qwen vision-language models (M-RoPE); "
            f"{type(lm).__name__} is not one yet: sample it with text prompts"
        )
    device = image_grid_thw.device
    tokens = torch.tensor([ids], dtype=torch.long, device=device)
    extra = {}
    if _takes_token_types(inner.get_rope_index):
        extra["mm_token_type_ids"] = token_types(lm, tokens)
    positions, _ = inner.get_rope_index(tokens, image_grid_thw=image_grid_thw, **extra)
    return positions[:, 0]
