"""The padded forward's image inputs on the Gemma vision-language families (Gemma 3, Gemma 4).

A Gemma row carries no grid sizes: each image is one entry of ``pixel_values`` (Gemma 3: a square
``(3, height, width)`` image; Gemma 4: its patches padded to the processor's budget, with their
positions in ``image_position_ids``), and the batch's ``image_counts`` say whose rows they are.

Beside the pixels, the forward needs to know which tokens are an image's: within one image the
soft tokens attend to each other both ways (Gemma 3 always, Gemma 4 where its text config says
``use_bidirectional_attention='vision'``), and without the token types transformers runs the
rows causally, unlike the rows the model's own processor makes. Gemma 3's forward takes them as
``token_type_ids``, Gemma 4's as ``mm_token_type_ids``; both are 1 at the image token.

These batches run padded. A packed row runs attention per sample and causally inside it
(``twinkle.kernel.attention.packed``), which cannot let one image's tokens see the ones after
them, and the families' sliding-window layers would need the window applied inside each sample;
so ``padding_free`` has no packed path here (nor for the Gemma text families), and a
``PackingDataset`` row with images is refused at collation."""

from collections.abc import Mapping
from typing import Any

import torch

from twinkle.utils.errors import UserError

# model_type -> (the batch keys its forward takes with the images, its name for the token types)
GEMMA_IMAGE_INPUTS = {
    "gemma3": (("pixel_values",), "token_type_ids"),
    "gemma4": (("pixel_values", "image_position_ids"), "mm_token_type_ids"),
}
FAMILY_NAMES = {"gemma3": "Gemma 3", "gemma4": "Gemma 4"}


def _check_rows(lm: Any, model_type: str, batch: Mapping[str, Any]) -> None:
    """One line when the rows' images are not in the shape this family's vision tower takes
    (rows encoded by another family's template)."""
    pixels = batch["pixel_values"]
    vision = lm.config.vision_config
    family = FAMILY_NAMES[model_type]
    hint = "the rows were encoded for another model family; encode them with this model's template (--template-cls)"
    if model_type == "gemma3":
        size = vision.image_size
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (3, size, size):
            raise UserError(
                f"the rows' images have shape {tuple(pixels.shape)}, but {family}'s vision tower takes "
                f"(images, 3, {size}, {size}): {hint}"
            )
        return
    width = 3 * vision.patch_size**2
    positions = batch.get("image_position_ids")
    if pixels.dim() != 3 or pixels.shape[-1] != width or positions is None:
        raise UserError(
            f"the rows' images have shape {tuple(pixels.shape)}"
            f"{'' if positions is not None else ' and no image_position_ids'}, but {family}'s vision tower "
            f"takes (images, patches, {width}) with their positions: {hint}"
        )


def check_row_family(lm: Any, batch: Mapping[str, Any]) -> None:
    """One line, before any forward (packed or padded), when the batch's images were encoded for
    the other kind of family: Gemma rows (no ``image_grid_thw``) on a Qwen model, or rows of
    another shape on a Gemma model."""
    if "pixel_values" not in batch:
        return
    model_type = getattr(lm.config, "model_type", None)
    if model_type in GEMMA_IMAGE_INPUTS:
        _check_rows(lm, model_type, batch)
    elif "image_grid_thw" not in batch:
        raise UserError(
            f"the rows' images carry no image_grid_thw, which {type(lm).__name__} needs: the rows were "
            "encoded for a Gemma model; encode them with this model's template (--template-cls)"
        )


def gemma_image_inputs(lm: Any, batch: Mapping[str, Any]) -> dict[str, Any] | None:
    """The padded forward's inputs for a batch with images on a Gemma model: the rows, their
    images and the token types under the forward's name; None for a model of another family."""
    model_type = getattr(lm.config, "model_type", None)
    if model_type not in GEMMA_IMAGE_INPUTS:
        check_row_family(lm, batch)
        return None
    _check_rows(lm, model_type, batch)
    keys, token_types = GEMMA_IMAGE_INPUTS[model_type]
    input_ids = batch["input_ids"]
    inputs = {"input_ids": input_ids, "attention_mask": batch["attention_mask"]}
    inputs.update({k: batch[k] for k in keys})
    inputs[token_types] = (input_ids == lm.config.image_token_id).to(torch.long)
    return inputs
