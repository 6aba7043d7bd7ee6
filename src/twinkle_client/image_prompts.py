"""Prompts with images for the server's sampler: a Tinker ``ModelInput`` whose text chunks hold
the prompt's tokens and whose ``ImageChunk``s (PNG bytes) stand where each image's placeholder
tokens were, which is the one way a sample request carries images (``asample`` takes no
arrays beside the prompt). The server runs its model's own image processor on each picture and
puts the placeholders back, so the pictures must be the ones the row's ``pixel_values`` were
made from.

A trajectory brings them (``Message.images``, read as the template reads them). An encoded row
brings only ``pixel_values`` and ``image_grid_thw``; its pictures are rebuilt from them: the
Qwen-VL processors resize a picture to its patch grid in 8-bit pixels, rescale and normalize,
and cut it into patches, all of which undoes exactly (the rebuilt picture is already at its
grid's size, which the processor's resize keeps as it is). Each rebuilt picture is run
through the processor here and must give the row's ``pixel_values`` back; one that does not is
refused in one line rather than sampled on other numbers than the row holds."""

import io
from typing import Any

import numpy as np

from twinkle.utils.errors import UserError

IMAGES = ("pixel_values", "image_grid_thw")


def _array(value: Any, dtype: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=dtype)


def png(picture: Any) -> bytes:
    out = io.BytesIO()
    picture.convert("RGB").save(out, format="PNG")
    return out.getvalue()


def rebuilt_pictures(row: dict[str, Any], template: Any, where: str) -> list[Any]:
    """The PIL pictures the row's ``pixel_values`` were processed from (see the module's
    docstring), each checked by processing it again."""
    from PIL import Image

    processor = template.processor.image_processor
    pixels = _array(row["pixel_values"], np.float32)
    grids = _array(row["image_grid_thw"], np.int64).reshape(-1, 3)
    p, m = int(processor.patch_size), int(getattr(processor, "merge_size", 1))
    t_patch = int(getattr(processor, "temporal_patch_size", 1))
    mean = np.broadcast_to(np.asarray(processor.image_mean, dtype=np.float64), (3,)).reshape(3, 1, 1)
    std = np.broadcast_to(np.asarray(processor.image_std, dtype=np.float64), (3,)).reshape(3, 1, 1)
    scale = float(getattr(processor, "rescale_factor", 1 / 255))
    if pixels.ndim != 2 or pixels.shape[1] != 3 * t_patch * p * p:
        raise UserError(
            f"{where}: pixel_values of shape {list(pixels.shape)} are not this model's image patches "
            f"(width {3 * t_patch * p * p}); encode the row with the served model's template"
        )
    patches_of = [int(t) * int(h) * int(w) for t, h, w in grids.tolist()]
    if sum(patches_of) != len(pixels):
        raise UserError(
            f"{where}: image_grid_thw covers {sum(patches_of)} patches but pixel_values holds {len(pixels)}"
        )
    pictures, start = [], 0
    for j, (t, gh, gw) in enumerate(grids.tolist()):
        if t != 1 or gh % m or gw % m:
            raise UserError(f"{where}: image {j} has grid {t}x{gh}x{gw}; only still images are sampled")
        patches = pixels[start : start + gh * gw].astype(np.float64)
        start += gh * gw
        patches = patches.reshape(gh // m, gw // m, m, m, 3, t_patch, p, p)[:, :, :, :, :, 0]
        image = patches.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * p, gw * p)
        values = np.rint((image * std + mean) / scale)
        if values.min() < -0.5 or values.max() > 255.5:
            raise UserError(
                f"{where}: image {j}'s pixel_values are not 8-bit pixels through this model's normalization; "
                "sample the trajectory (Message.images) instead"
            )
        pictures.append(Image.fromarray(values.clip(0, 255).astype(np.uint8).transpose(1, 2, 0), "RGB"))
    again, _ = template.process_images(pictures)
    if not np.allclose(again["pixel_values"].numpy(), pixels, rtol=0, atol=1e-5) or not np.array_equal(
        again["image_grid_thw"].numpy(), grids
    ):
        raise UserError(
            f"{where}: its pictures cannot be rebuilt from its pixel_values (the model's processor makes "
            "other numbers of them); sample the trajectory (Message.images) instead"
        )
    return pictures


def model_input(ids: list[int], template: Any, pictures: list[Any], grids: Any, where: str) -> Any:
    """``ids`` as text chunks with ``pictures[j]`` an ``ImageChunk`` in place of image ``j``'s run
    of placeholder tokens (as many as its grid in ``grids`` makes, its ``expected_tokens``)."""
    from tinker import types

    counts = [template.image_tokens(g) for g in _array(grids, np.int64).reshape(-1, 3)]
    image_id = int(template.image_token_id)
    chunks: list[Any] = []
    last, at = 0, 0
    for j, (picture, count) in enumerate(zip(pictures, counts, strict=True)):
        at = ids.index(image_id, last) if image_id in ids[last:] else -1
        if at < 0 or ids[at : at + count] != [image_id] * count:
            raise UserError(
                f"{where}: its input_ids do not hold image {j}'s {count} placeholder tokens "
                f"{template.image_token} where its images say; encode the row and its images together"
            )
        if at > last:
            chunks.append(types.EncodedTextChunk(tokens=ids[last:at]))
        chunks.append(types.ImageChunk(data=png(picture), format="png", expected_tokens=count))
        last = at + count
    if image_id in ids[last:]:
        found = ids.count(image_id) - sum(counts)
        raise UserError(
            f"{where}: {found} image placeholder token(s) {template.image_token} beyond its "
            f"{len(counts)} image(s); give each image its pixel_values and image_grid_thw"
        )
    if last < len(ids):
        chunks.append(types.EncodedTextChunk(tokens=ids[last:]))
    return types.ModelInput(chunks=chunks)


def has_images(row: Any) -> bool:
    return isinstance(row, dict) and any(row.get(k) is not None for k in IMAGES)


def served_template(served: str) -> Any:
    """The vision-language template the server places the served model's images with, for rows
    that bring images without a template set; None for a model the server reads text only."""
    from twinkle.server.common import local_model_id
    from twinkle.server.images import TEMPLATES, load_vision

    vision = load_vision(local_model_id(served))
    if vision is not None and vision.template is None:
        raise UserError(
            f"the served model is {vision.model_type}; the server places images for "
            f"{', '.join(sorted(TEMPLATES))} models"
        )
    if vision is not None and vision.gemma:  # the chunks here are built from Qwen's patch grids
        raise UserError(
            f"the served model is {vision.model_type}, whose images this client does not send yet; "
            "send each image as a tinker ImageChunk in place of its soft tokens (tinker SDK)"
        )
    return None if vision is None else vision.template


def prompt_input(prompt: Any, template: Any, where: str) -> tuple[Any, list[int], dict[str, Any]]:
    """``(ModelInput, input_ids, images)`` of a prompt: token ids, a ``ModelInput`` (sent as it
    is), or an encoded row (``input_ids``, and ``pixel_values`` with ``image_grid_thw`` when it
    has images, placed as ``model_input`` says). ``template``: a callable giving the
    vision-language template, called only for a row with images. ``images``: the row's
    ``pixel_values`` and ``image_grid_thw``, empty without."""
    from tinker import types

    if isinstance(prompt, types.ModelInput):
        return prompt, prompt.to_ints() if all(c.type == "encoded_text" for c in prompt.chunks) else [], {}
    if not isinstance(prompt, dict):
        ids = [int(t) for t in (prompt.tolist() if hasattr(prompt, "tolist") else prompt)]
        return types.ModelInput.from_ints(ids), ids, {}
    if "input_ids" not in prompt:
        raise UserError(f"{where} has no input_ids; encode it first (set_template, or Template.encode)")
    ids = _array(prompt["input_ids"], np.int64).reshape(-1).tolist()
    given = [k for k in IMAGES if prompt.get(k) is not None]
    if not given:
        return types.ModelInput.from_ints(ids), ids, {}
    if len(given) == 1:
        raise UserError(f"{where} has {given[0]} without the other of {', '.join(IMAGES)}")
    vl = template()
    pictures = rebuilt_pictures(prompt, vl, where)
    images = {k: prompt[k] for k in IMAGES}
    return model_input(ids, vl, pictures, prompt["image_grid_thw"], where), ids, images


def trajectory_input(trajectory: Any, template: Any, where: str) -> tuple[Any, list[int], dict[str, Any]]:
    """``prompt_input``'s triple of a trajectory, encoded by ``template`` with its generation
    prompt; its images (``Message.images``) go as they are read, not rebuilt."""
    from tinker import types

    from twinkle.template.images import place_images
    from twinkle.template.rows import messages_of, without_empty_reply

    row = template.encode(trajectory, add_generation_prompt=True)
    if row is None:
        raise UserError(f"{where}: its prompt is longer than the template's max_length and was dropped")
    ids = _array(row["input_ids"], np.int64).reshape(-1).tolist()
    if not has_images(row):
        return types.ModelInput.from_ints(ids), ids, {}
    _, pictures = place_images(without_empty_reply(messages_of(trajectory)[0]))
    images = {k: row[k] for k in IMAGES}
    return model_input(ids, template, pictures, row["image_grid_thw"], where), ids, images
