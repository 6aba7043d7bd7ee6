"""Padding-free batches of image rows on the Qwen vision-language families (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Qwen3.5): the samples laid end to end in one row, as
``twinkle.model.packing`` lays out text rows, with each kept image's patches and each token's
M-RoPE positions. Qwen3.5's linear-attention layers run each sample's span on its own
(``twinkle.model.linear_attention_packing``).

What a packed image row needs beyond a text one:

- positions: the model's own ``get_rope_index`` gives every token of the padded batch its three
  M-RoPE positions (time, height, width); each token keeps its own in the row. The forward takes
  them as ``(4, 1, T)``: the text position (0, 1, ... within each sample) first, which these
  families' language models read as ``position_ids`` for attention, then the three rotary axes.
  Rows hold still images only, so Qwen2.5-VL's video time scale (``second_per_grid_ts``) never
  enters; a row holding a video placeholder is refused (``check_no_video``).
- images: a sample's tail after its last target is left out of the row; an image there (in a
  turn after the last reply) is left out with its tokens, and a sample without a target takes
  its images out with it. Images are whole or absent: their tokens are never targets, so the cut
  never falls inside one. The kept images' patches go to the vision tower in row order, the
  order in which the model places their features (and Qwen3-VL's deepstack features) at the
  tokens.
- no shared prefix: two samples' image tokens look alike whatever their pixels, so a prefix
  held once could hold one sample's image for several; every sample keeps its own tokens.
- attention: the language model's attention runs per sample (``twinkle_segments``). The vision
  tower works out its own per-image segments from the grids (and Qwen2.5-VL its windows inside
  each image), so it must never see the language row's segments: a pre-hook on the tower drops
  them before its blocks run.

The loss and gradients equal those of the padded batch up to summation order."""

from collections.abc import Sequence
from typing import Any

import torch

from twinkle.kernel.attention.packed import enable_segment_attention
from twinkle.model.linear_attention_packing import run_per_sample
from twinkle.model.packing import pack
from twinkle.model.vision import check_patches
from twinkle.model.vision_positions import token_types
from twinkle.utils.errors import UserError

# Qwen3.5's linear-attention layers run each sample on its own (linear_attention_packing)
PACKABLE_VISION_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
_HOOKED = "_twinkle_drops_segments"


def can_pack_images(lm: Any, share_prefix: bool | Sequence[Any]) -> bool:
    """Whether ``lm``'s batches run packed here: a Qwen VL model whose attention takes segments, with
    one adapter for the whole batch (rows of several adapters run padded)."""
    if getattr(lm.config, "model_type", None) not in PACKABLE_VISION_TYPES:
        return False
    if not isinstance(share_prefix, bool):
        return False
    return enable_segment_attention(lm.config)


def _inner(lm: Any) -> Any:
    """The ``*Model`` under ``*ForConditionalGeneration`` (its ``visual`` and ``get_rope_index``)."""
    return lm.model if hasattr(lm.model, "get_rope_index") else lm


def check_no_video(lm: Any, input_ids: torch.Tensor) -> None:
    """One line when the rows hold a video placeholder token: rows carry images only (their
    patches and grids), so a video's tokens would have no frames or timing behind them."""
    video = getattr(lm.config, "video_token_id", None)
    if video is not None and bool((input_ids == video).any()):
        rows = sorted({int(r) for r in (input_ids == video).nonzero()[:, 0].tolist()})
        raise UserError(
            f"batch row(s) {rows} hold the video placeholder token (id {video}), but rows carry images "
            "only; give the frames as images (Message(images=[...])) and drop the video token from the text"
        )


def _drop_segments(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    kwargs.pop("twinkle_segments", None)
    return args, kwargs


def _hook_vision_tower(visual: Any) -> None:
    if not getattr(visual, _HOOKED, False):
        visual.register_forward_pre_hook(_drop_segments, with_kwargs=True)
        setattr(visual, _HOOKED, True)


def _rope_positions(lm: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(3, B, L)``: each token's M-RoPE positions in the padded batch."""
    ids = batch["input_ids"]
    grids = batch.get("image_grid_thw")
    positions, _ = _inner(lm).get_rope_index(
        ids,
        mm_token_type_ids=token_types(lm, ids),
        image_grid_thw=grids,
        attention_mask=batch["attention_mask"],
    )
    return positions


def _kept_images(
    lm: Any, batch: dict[str, torch.Tensor], where: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(pixel_values, image_grid_thw)`` of the images whose tokens the row keeps, in row order;
    None when it keeps none."""
    grids = batch["image_grid_thw"]
    counts = batch["image_counts"].tolist()
    merge = lm.config.vision_config.spatial_merge_size**2
    is_image = batch["input_ids"] == lm.config.image_token_id
    tokens = (grids.prod(dim=1) // merge).tolist()
    patches = grids.prod(dim=1).tolist()
    keep: list[int] = []
    first = 0
    for row, count in enumerate(counts):
        kept = int((is_image[row] & (where[row] >= 0)).sum())
        for k in range(first, first + count):
            if kept <= 0:
                break
            assert kept >= tokens[k], "a packed row cut an image's tokens"
            keep.append(k)
            kept -= tokens[k]
        first += count
    if not keep:
        return None
    starts = [0]
    for n in patches:
        starts.append(starts[-1] + n)
    rows = torch.cat([torch.arange(starts[k], starts[k + 1]) for k in keep]).to(grids.device)
    return batch["pixel_values"][rows], grids[keep]


def pack_images(lm: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """``pack`` for a Qwen VL batch, with or without images: the packed row's inputs with
    ``(4, 1, T)`` position ids and the kept images (see the module docstring); None when the
    batch does not pack (``pack``'s reasons)."""
    check_no_video(lm, batch["input_ids"])
    run_per_sample(lm)
    packed = pack(batch, share_prefix=False)
    if packed is None:
        return None
    where = packed["where"]
    kept = where >= 0
    rope = torch.zeros((3, packed["input_ids"].shape[1]), dtype=torch.long, device=where.device)
    rope[:, where[kept]] = _rope_positions(lm, batch)[:, kept]
    packed["position_ids"] = torch.cat([packed["position_ids"], rope])[:, None]
    if "pixel_values" in batch:
        check_patches(lm, batch["pixel_values"])
        images = _kept_images(lm, batch, where)
        if images is not None:
            _hook_vision_tower(_inner(lm).visual)
            packed["pixel_values"], packed["image_grid_thw"] = images
    return packed
