"""Prompts with images: checked against the model, and prefilled with their pixels and, on the
Qwen families, M-RoPE positions (``twinkle.model.vision_positions``); on the Gemma families with
plain positions and the token types that make an image's tokens attend both ways
(``twinkle.sampler.gemma_images``).

A Qwen prompt's images are its ``pixel_values`` (the patches of all its images, one after another)
and ``image_grid_thw`` (one ``(t, h, w)`` per image), as the vision-language template encodes them;
a Gemma prompt's are one ``pixel_values`` entry per image (and Gemma 4's ``image_position_ids``).
The prefill runs as ``Decoder._prefill`` does for text (left-padded rows, the prompts' common
prefix once in a row of its own), with three differences:

- on Qwen, each row's positions are the model's M-RoPE positions of its whole prompt (three
  axes), cut where the forward starts; a text-only row in the batch has its plain positions on
  all three. On Gemma each forward gets the token types of its rows from their first token;
- each forward gets the images whose tokens it runs, in row order (the model puts the vision
  tower's outputs at the image tokens in that order);
- the common prefix runs apart only where every prompt has the same images in it (equal image
  tokens do not mean equal pixels), and never ends inside an image's tokens: otherwise it ends
  before its first image (GRPO's copies of one prompt share the whole prompt, images included).
  On a model with sliding-window or linear-attention layers (Gemma, Qwen3.5) it also runs apart
  only where the rest of every prompt is equally long (``Decoder.even_rests``): pads between the
  prefix and a shorter rest would take up window slots or decay the recurrent state.

Decoding then goes on from each row's largest prompt position plus one, on every axis, as
``generate`` continues a Qwen-VL prompt."""

from typing import Any

import torch

from twinkle.model.vision_inputs import check_row_family
from twinkle.model.vision_positions import reads_images, rope_positions
from twinkle.sampler.gemma_images import (
    gemma_counts,
    gemma_images,
    gemma_vision_of,
    image_token_types,
    is_gemma,
)
from twinkle.utils.errors import UserError

Vision = dict[str, torch.Tensor]  # pixel_values, image_grid_thw (Qwen) or image_position_ids (Gemma 4)
# families with a text-only class whose checkpoints sample with images when they have an image processor
IMAGE_PATH_TYPES = ("qwen3_5", "qwen3_5_moe")


def image_text_class(model_id: str | None) -> Any:
    """``'AutoModelForImageTextToText'`` for a vision-language checkpoint, so that a sampler given
    its folder alone reads images, as a vLLM engine does: a family with no text-only class that
    ``AutoModelForCausalLM`` loads (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), and Qwen3.5 with its image
    processor saved beside it (where upstream's ``Qwen3_5Template`` encodes images: the sampler's
    model then has the vision tower the template's rows need, and the trainer's parameter names).
    Else None (the default class): a Qwen3.5 folder without an image processor samples with its
    language model alone."""
    import json

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from twinkle.hub import resolve_model

    if model_id is None:
        return None
    try:
        config = json.loads((resolve_model(model_id) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the loader says what is wrong with the folder
    if not isinstance(config, dict) or "vision_config" not in config:
        return None
    model_type = config.get("model_type")
    if model_type in IMAGE_PATH_TYPES and (resolve_model(model_id) / "preprocessor_config.json").is_file():
        return "AutoModelForImageTextToText"
    return None if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else "AutoModelForImageTextToText"


def placeholder_ids(lm: Any, device: torch.device) -> torch.Tensor | None:
    """The image and video placeholder tokens of a model with a vision tower (None: none). A
    sampler never draws them: the trainer's forward would look for an image behind each."""
    if not reads_images(lm):
        return None
    ids = [getattr(lm.config, key, None) for key in ("image_token_id", "video_token_id")]
    ids = [i for i in ids if isinstance(i, int)]
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


def vision_of(row: Any) -> Vision | None:
    """A prompt row's images as tensors (None: it has none); a row without grid sizes is a Gemma
    template's."""
    if row.get("pixel_values") is None:
        return None
    if row.get("image_grid_thw") is None:
        return gemma_vision_of(row)
    grids = torch.as_tensor(row.get("image_grid_thw"), dtype=torch.long).reshape(-1, 3)
    return {"pixel_values": torch.as_tensor(row["pixel_values"]), "image_grid_thw": grids}


def image_counts(lm: Any, vision: Vision | None) -> list[int]:
    """How many image tokens each of the prompt's images takes in ``lm``."""
    if vision is None:
        return []
    if is_gemma(lm):
        return gemma_counts(lm, vision)
    merge = int(getattr(lm.config.vision_config, "spatial_merge_size", 1))
    return [int(g.prod()) // (merge * merge) for g in vision["image_grid_thw"]]


def check_images(lm: Any, index: int, ids: list[int], vision: Vision | None, limit: int | None) -> None:
    """One line when row ``index``'s images do not fit ``lm``: images for a model that reads text
    only, more images than ``limit`` (``engine_args['limit_mm_per_prompt']``), or image tokens
    that do not match the images."""
    if not reads_images(lm):
        if vision is not None:
            raise UserError(
                f"input row {index} holds images (pixel_values), but the sampler's model "
                f"({type(lm).__name__}) reads text only; load the vision-language class "
                "(TorchSampler(model_id, model_cls=...), TransformersModel(model_id, model_cls=...))"
            )
        return
    if vision is not None:
        try:  # rows of the other kind of family (Gemma rows on a Qwen model, or the reverse)
            check_row_family(lm, vision)
        except UserError as exc:
            raise UserError(f"input row {index}: {exc}") from None
    counts = image_counts(lm, vision)
    if limit is not None and len(counts) > limit:
        raise UserError(
            f"input row {index} holds {len(counts)} images, more than engine_args "
            f"limit_mm_per_prompt allows ({limit}); give fewer images or raise the limit"
        )
    found = sum(1 for t in ids if t == lm.config.image_token_id)
    if found != sum(counts):
        raise UserError(
            f"input row {index} has {found} image tokens, but its images (image_grid_thw) take "
            f"{sum(counts)}; encode the prompt with the model's template (and keep its pixel_values)"
        )


def _images(vision: Vision | None) -> list[Vision]:
    """Each image's own entries of the prompt's (Qwen: its patches and a one-row grid), which
    ``_joined`` puts back together for any choice of images."""
    if vision is None:
        return []
    if "image_grid_thw" not in vision:
        return gemma_images(vision)
    grids = vision["image_grid_thw"]
    patches = vision["pixel_values"].split([int(g.prod()) for g in grids])
    return [{"pixel_values": p, "image_grid_thw": g[None]} for p, g in zip(patches, grids, strict=True)]


def _joined(images: list[Vision], device: torch.device) -> Vision | None:
    if not images:
        return None
    return {key: torch.cat([image[key] for image in images]).to(device) for key in images[0]}


def _same(a: Vision, b: Vision) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def prefix_with_images(
    prompts: list[list[int]], images: list[list[Vision]], counts: list[list[int]], shared: int, image_id: int
) -> tuple[int, int]:
    """``(shared, k)``: the common prefix cut back so it holds whole images only (the first
    ``k`` of each prompt), the same in every prompt, or else cut before its first image."""
    head = prompts[0][:shared]
    starts = [i for i, t in enumerate(head) if t == image_id and (i == 0 or head[i - 1] != image_id)]
    taken = [i for i, t in enumerate(head) if t == image_id]
    k, used = 0, 0
    while k < len(counts[0]) and used + counts[0][k] <= len(taken):
        used, k = used + counts[0][k], k + 1
    if used < len(taken):  # the prefix ends inside image k: it stops before that image
        shared = taken[used]
    first = images[0][:k]
    for other in images[1:]:
        if len(other) < k or not all(_same(a, b) for a, b in zip(first, other[:k], strict=True)):
            return starts[0], 0  # other pixels behind the same tokens: the text before them only
    return shared, k


def prefill_with_images(
    decoder: Any,
    prompts: list[list[int]],
    visions: list[Vision | None],
    shared: int,
    shared_min: int,
    cache_state: Any,
) -> tuple:
    """``Decoder._prefill`` for prompts of which some hold images; ``(logits, state)`` as it
    returns them. ``shared``: the prompts' common prefix by their tokens, run apart when it
    saves ``shared_min`` tokens once cut to its images; ``cache_state``: the decoder's
    ``CacheState`` class."""
    lm, device = decoder.lm, decoder.device
    gemma = is_gemma(lm)
    counts = [image_counts(lm, v) for v in visions]
    images = [_images(v) for v in visions]
    k = 0
    if shared:
        shared, k = prefix_with_images(prompts, images, counts, shared, lm.config.image_token_id)
        uneven = decoder.even_rests and len({len(p) - shared for p in prompts}) > 1  # module docstring
        if shared * (len(prompts) - 1) < shared_min or uneven:
            shared, k = 0, 0
    rests = [p[shared:] for p in prompts]
    width = max(len(p) for p in rests)
    ids = torch.full((len(prompts), width), decoder.pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(rests):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    if gemma:  # plain positions, counting each row's real tokens
        full = None
        positions = shared + (mask.cumsum(-1) - 1).clamp(min=0)
    else:
        full = [
            rope_positions(lm, p, v["image_grid_thw"])
            if v is not None
            else torch.arange(len(p)).expand(3, -1)
            for p, v in zip(prompts, visions, strict=True)
        ]
        positions = torch.zeros((3, len(prompts), width), dtype=torch.long)
        for i, p in enumerate(rests):
            positions[:, i, width - len(p) :] = full[i][:, shared:].cpu()
    padded = any(len(p) < width for p in rests)
    mask = mask.to(device)
    head = torch.tensor([prompts[0][:shared]], dtype=torch.long)
    if shared:
        state = cache_state(lm.config, torch.ones((1, shared), dtype=torch.long, device=device), False)
        head_positions = torch.arange(shared)[None] if gemma else full[0][:, None, :shared]
        head_inputs = _joined(images[0][:k], device) or {}
        if gemma:
            head_inputs.update(image_token_types(lm, head.to(device)))
        decoder._forward(head.to(device), state, head_positions.to(device), head_inputs)
        if decoder.routes is not None:
            decoder.routes.prefix_ran()
        state.repeat(len(prompts))
        state.mask, state.padded = torch.cat([state.mask, mask], dim=1), padded
    else:
        state = cache_state(lm.config, mask, padded)
    inputs = _joined([image for row in images for image in row[k:]], device) or {}
    if gemma:  # the token types of the whole rows, the cached prefix's included
        inputs.update(
            image_token_types(lm, torch.cat([head.expand(len(prompts), -1), ids], dim=1).to(device))
        )
    logits = decoder._forward(ids.to(device), state, positions.to(device), inputs)
    if decoder.routes is not None:
        decoder.routes.prompts_ran([len(p) for p in rests], width)
    if full is not None:  # decoding goes on after each prompt's largest position (its last image may end it)
        state.next_positions = torch.stack([f.max() + 1 for f in full]).to(device)
    n = decoder.params.num_samples
    if n > 1:
        state.repeat(n)
        logits = logits.repeat_interleave(n, dim=0)
    return logits, state
